"""Discrete-event simulation of asynccoll's real schedules, calibration and trace replay.

* :mod:`.engine`: virtual time, messages, and an interpreter of committed schedules with the
  executor's semantics (:class:`SimWorld`, :class:`SimExecutor`);
* :mod:`.handle` and :mod:`.dense`: the partial allreduce's call rules and flush in virtual time
  (:class:`SimPartial`), a dense allreduce and a barrier; :mod:`.sparse`: the sparse
  allreduce (:class:`SimSparse`, data mode);
* :mod:`.run`: a training loop under one policy (:func:`simulate` -> :class:`SimRun`);
* :mod:`.arrivals`: compute-time models (linear skew, shifted, lognormal, Pareto, slow group,
  replayed traces);
* :mod:`.cost` and :mod:`.profiles`: the cost model and the shipped profiles;
* :mod:`.policy`: the runtime's policy values in the simulator (:func:`parse_policies`) and
  the adaptive deadline (:func:`next_deadline`);
* :mod:`.calibrate` and :mod:`.replay`: ``asynccoll sim calibrate`` and ``asynccoll sim
  replay`` (:mod:`.cli`).

Nothing below this package imports it.
"""

from .arrivals import (
    ComputeModel,
    Constant,
    LinearSkew,
    LogNormal,
    Pareto,
    Replayed,
    Shifted,
    SlowGroup,
    Uniform,
    parse_model,
)
from .cost import LinkClass, Profile
from .dense import SimBarrier, SimSync
from .engine import SimExecutor, SimulationError, SimWorld
from .handle import SimPartial
from .policy import next_deadline, parse_policies
from .profiles import BUILTIN_PROFILES, builtin_profile
from .run import SimRun, simulate
from .sparse import SimSparse

__all__ = [
    "BUILTIN_PROFILES",
    "ComputeModel",
    "Constant",
    "LinearSkew",
    "LinkClass",
    "LogNormal",
    "Pareto",
    "Profile",
    "Replayed",
    "Shifted",
    "SimBarrier",
    "SimExecutor",
    "SimPartial",
    "SimRun",
    "SimSparse",
    "SimSync",
    "SimWorld",
    "SimulationError",
    "SlowGroup",
    "Uniform",
    "builtin_profile",
    "next_deadline",
    "parse_model",
    "parse_policies",
    "simulate",
]
