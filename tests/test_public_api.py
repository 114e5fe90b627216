"""The public namespace re-exports exactly what it should, and every name resolves."""

from __future__ import annotations

import re

import asynccoll

#: The public API. A name added to ``asynccoll.__all__`` is added here in the same change.
EXPECTED = {
    "AsyncCollError",
    "AuthenticationError",
    "BufRef",
    "BusyError",
    "CollectiveTimeoutError",
    "Communicator",
    "ExecutionError",
    "Executor",
    "Op",
    "PartialAllreduce",
    "PartialResult",
    "PeerLostError",
    "ProtocolError",
    "Schedule",
    "ScheduleError",
    "SlotSpec",
    "TransportClosedError",
    "TransportError",
    "__version__",
    "connect",
    "init",
    "register_kernel",
    # straggler policies as values (asynccoll.collectives.policy)
    "Accumulate",
    "Backup",
    "DataPath",
    "Deadline",
    "Majority",
    "Policy",
    "Quorum",
    "Solo",
    "Sync",
    "TwoChoice",
    "as_policy",
    # sparse allreduce (asynccoll.collectives.sparse, .feedback)
    "ErrorFeedback",
    "SparseAllreduceHandle",
    "SparseVector",
    # training-loop API (asynccoll.train)
    "BackupSGD",
    "EagerSGD",
    "ODSGD",
    "RNA",
    "StepInfo",
    "TopKSGD",
    # launcher and inspection errors (asynccoll.errors; raised by asynccoll.launch / .inspect)
    "ConfigError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StoreError",
    "StoreTimeoutError",
    "TraceFormatError",
}


def test_all_is_exactly_the_public_api() -> None:
    assert set(asynccoll.__all__) == EXPECTED
    assert len(asynccoll.__all__) == len(set(asynccoll.__all__))


def test_every_exported_name_resolves() -> None:
    for name in asynccoll.__all__:
        assert getattr(asynccoll, name) is not None, name


def test_star_import_gives_all_and_nothing_else() -> None:
    ns: dict[str, object] = {}
    exec("from asynccoll import *", ns)
    assert set(ns) - {"__builtins__"} == set(asynccoll.__all__)


def test_errors_share_one_base() -> None:
    for name in asynccoll.__all__:
        obj = getattr(asynccoll, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, asynccoll.AsyncCollError), name


def test_public_objects_say_they_belong_to_the_package() -> None:
    for name in asynccoll.__all__:
        obj = getattr(asynccoll, name)
        if hasattr(obj, "__module__"):
            assert obj.__module__.startswith("asynccoll"), name


def test_error_tree_in_errors_docstring_names_every_public_error() -> None:
    import asynccoll.errors

    named = set(re.findall(r"\b(\w+Error)\b", asynccoll.errors.__doc__ or ""))
    for name in asynccoll.__all__:
        obj = getattr(asynccoll, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert name in named, name
