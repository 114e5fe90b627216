"""Rendezvous and launch: ``connect()``, the store, environment detection, ``asynccoll run``.

``resolve()`` says who this process is in the job (:class:`JobSpec`); ``rendezvous(spec)``
returns its transport connected to every peer; ``StoreServer`` / ``StoreClient`` are the
authenticated key-value store they meet in; ``launch(LaunchConfig)`` runs one node's ranks. The
names are imported on first use (:mod:`asynccoll.transport.lazy`): the launcher and its reaper
do not import the runtime that ``connect()`` needs."""

from typing import TYPE_CHECKING

from ..transport.lazy import exports

if TYPE_CHECKING:
    from .connect import DEFAULT_COLLECTIVE_TIMEOUT, connect
    from .env import ConfigError, JobSpec, listen_host, resolve
    from .rendezvous import RendezvousError, RendezvousTimeoutError, rendezvous
    from .runner import LaunchConfig, launch
    from .store import (
        BlockingStoreClient,
        StoreClient,
        StoreError,
        StoreLimits,
        StoreServer,
        StoreTimeoutError,
    )

_WHERE = {"BlockingStoreClient": ".store", "ConfigError": ".env", "connect": ".connect",
          "DEFAULT_COLLECTIVE_TIMEOUT": ".connect", "JobSpec": ".env", "launch":
          ".runner", "LaunchConfig": ".runner", "listen_host": ".env", "rendezvous":
          ".rendezvous", "RendezvousError": ".rendezvous", "RendezvousTimeoutError":
          ".rendezvous", "resolve": ".env", "StoreClient": ".store", "StoreError":
          ".store", "StoreLimits": ".store", "StoreServer": ".store",
          "StoreTimeoutError": ".store"}
__getattr__, __dir__ = exports(__name__, _WHERE, globals())

__all__ = [
    "BlockingStoreClient",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "ConfigError",
    "JobSpec",
    "LaunchConfig",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StoreClient",
    "StoreError",
    "StoreLimits",
    "StoreServer",
    "StoreTimeoutError",
    "connect",
    "launch",
    "listen_host",
    "rendezvous",
    "resolve",
]
