"""Rendezvous and launch: ``connect()``, the store, environment detection, ``asynccoll run``.

``resolve()`` says who this process is in the job (:class:`JobSpec`); ``rendezvous(spec)``
returns its transport connected to every peer; ``StoreServer`` / ``StoreClient`` are the
authenticated key-value store they meet in; ``launch(LaunchConfig)`` runs one node's ranks.
"""

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
