"""One rank of tests/adversarial/test_survived_bytes.py, under ``asynccoll run -n 4
--max-failures 1``.

Every case of a part is made first and stepped in lockstep (case after case within a step), so
rank ``VICTIM`` (env ``SURVIVED_VICTIM``, default 3) dies by SIGKILL in the middle of one step
of every case at once: at step ``KILL_AT``, after half the cases took it. The survivors go on,
``finish()`` every case and compare its raw bytes over the survivors' communicator (the
partial handle's ``communicator``). Prints, per surviving rank:

* ``SURVIVED DIFFER <case>`` for a case whose bytes differ between survivors,
  ``SURVIVED WORLD <case> <size>`` for one that did not go on among the 3 survivors,
  ``SURVIVED DIVISOR <case> <values>`` (torch) for a quorum:4 case whose probe step after the
  loss (every survivor's gradient ``rank + 1``, all of them in the round) did not hand the
  optimizer their sum divided by the 3 survivors, and ``SURVIVED OK <rank> <cases>`` when
  none happened (``SURVIVED BAD <rank>`` otherwise);
* for a case documented to end on a loss: ``ENDED <case> <error type> rank=<r> after=<s>``,
  ``<r>`` the rank the error names and ``<s>`` the seconds from this rank's last step of it
  that returned to the error; ``STILL <case>`` if it never raised.

Parts (the first argument): ``numpy`` (RNA, EagerSGD, BackupSGD), ``sync`` (ODSGD and
TopKSGD: synchronous rounds, settled or redone over the survivors, asynccoll/train/rounds.py),
``torch`` (every
``DistributedOptimizer`` policy and algorithm, and the DDP ``partial_hook``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from _replica_rank import grad, jitter

import asynccoll
from asynccoll import Majority, PeerLostError, Quorum
from asynccoll.train import ODSGD, RNA, BackupSGD, EagerSGD, TopKSGD

N, STEPS, KILL_AT = 517, 10, 4
VICTIM = int(os.environ.get("SURVIVED_VICTIM", "3"))
SURVIVORS = 3


@dataclass
class Case:
    label: str
    opt: Any
    average: bool = True  # finish(average=...)
    ends: bool = False  # documented to end on a loss (a synchronous collective)
    ended: str | None = None  # the error that ended it
    last_ok: float = 0.0


def die_here(rank: int, step: int, i: int, cases: list[Case]) -> None:
    """SIGKILL the victim in the middle of step KILL_AT: after half the cases took it."""
    if rank == VICTIM and step == KILL_AT and i == len(cases) // 2:
        os.kill(os.getpid(), signal.SIGKILL)


def ended(c: Case, exc: PeerLostError) -> None:
    c.ended = f"{type(exc).__name__} rank={exc.rank} after={time.monotonic() - c.last_ok:.1f}"


def report(rank: int, bad: list[str], cases: list[Case]) -> None:
    for c in cases:
        if c.ended is not None:
            print(f"ENDED {c.label} {c.ended}", flush=True)
            if not c.ends:
                bad.append(f"RAISED {c.label}")
        elif c.ends:
            print(f"STILL {c.label}", flush=True)
    for what in bad:
        print(f"SURVIVED {what}", flush=True)
    kept = sum(c.ended is None for c in cases)
    print(f"SURVIVED OK {rank} {kept}" if not bad else f"SURVIVED BAD {rank}", flush=True)


async def compare(survivors: Any, cases: list[Case]) -> None:
    """Compare every finished case's raw bytes and world over the survivors' communicator and
    report (module doc)."""
    bad: list[str] = []
    for c in cases:
        if c.opt.world_size != SURVIVORS:
            bad.append(f"WORLD {c.label} {c.opt.world_size}")
        everyone = await survivors.allgather(np.ascontiguousarray(c.opt.params).view(np.uint8))
        if any(bytes(row) != bytes(everyone[0]) for row in everyone):
            bad.append(f"DIFFER {c.label}")
    report(survivors.rank, bad, cases)


# -- NumPy training classes ------------------------------------------------------------------
def numpy_makers(comm: Any, dtype: Any) -> list[tuple[str, Callable[[str], Any]]]:
    def w() -> np.ndarray:
        return np.zeros(N, dtype)

    return [
        ("RNA", lambda t: RNA(comm, w(), lr=0.02, accumulate=True, name=t)),
        ("RNA latest", lambda t: RNA(comm, w(), lr=0.02, name=t)),
        ("RNA bound=1", lambda t: RNA(comm, w(), lr=0.02, accumulate=True, staleness_bound=1,
                                      name=t)),
        ("EagerSGD majority", lambda t: EagerSGD(comm, w(), policy=Majority(), lr=0.02,
                                                 accumulate=True, name=t)),
        ("EagerSGD contributions", lambda t: EagerSGD(comm, w(), policy=Quorum(3), lr=0.02,
                                                      accumulate=True,
                                                      average="contributions", name=t)),
        ("BackupSGD", lambda t: BackupSGD(comm, w(), lr=0.02, name=t)),
    ]


async def numpy_part() -> None:
    async with await asynccoll.connect(collective_timeout=60) as comm:
        assert comm.survive, "run under asynccoll run --max-failures 1"
        cases = [Case(f"{label} {np.dtype(dtype).name} average={average}",
                      make(f"survived-{k}-{dtype.__name__}-{average}"), average)
                 for dtype in (np.float32, np.float64) for average in (True, False)
                 for k, (label, make) in enumerate(numpy_makers(comm, dtype))]
        rng = np.random.default_rng(comm.rank)
        # started together: majority and two_choice handles stepped one after another wait on
        # each other in a circle when a rank starts a whole step late (docs/partial.md, "What a
        # call returns"; seen once in CI and 2 of 200 runs under load before this barrier)
        await comm.barrier()
        for step in range(STEPS):
            jitter(rng)
            for i, c in enumerate(cases):
                die_here(comm.rank, step, i, cases)
                await c.opt.step(grad(c.opt.params, rng))
        for c in cases:
            await c.opt.finish(average=c.average)
        await compare(cases[0].opt._h.communicator, cases)


# -- ODSGD and TopKSGD: synchronous rounds that go on over the survivors ----------------------
async def sync_part() -> None:
    async with await asynccoll.connect(collective_timeout=60) as comm:
        assert comm.survive, "run under asynccoll run --max-failures 1"
        cases = [Case("ODSGD", ODSGD(comm, np.zeros(N), lr=0.02, warmup=2)),
                 Case("ODSGD dc-asgd-a", ODSGD(comm, np.zeros(N), lr=0.02, warmup=2,
                                               local="dc-asgd-a", name="survived-odsgd-a")),
                 Case("TopKSGD", TopKSGD(comm, np.zeros(N), lr=0.02, density=0.1,
                                         name="survived-topk")),
                 Case("TopKSGD momentum", TopKSGD(comm, np.zeros(N), lr=0.02, k=7, momentum=0.9,
                                                  name="survived-topk-m"))]
        rng = np.random.default_rng(comm.rank)
        for step in range(STEPS):
            jitter(rng)
            for i, c in enumerate(cases):
                die_here(comm.rank, step, i, cases)
                await c.opt.step(grad(c.opt.params, rng))  # a raise fails the job
        for c in cases:
            await c.opt.finish()
        await compare(cases[0].opt._comm_now(), cases)  # the survivors' (train/rounds.py)


# -- torch: DistributedOptimizer and the DDP hook --------------------------------------------
#: (policy, algorithm, dtype, finish(average=)): every policy and algorithm docs/torch.md
#: documents as ending equal, each in float32 and float64, the two finishes alternating
OPTIMIZER_CASES = [
    (policy, algorithm, d, (i + j) % 2 == 0)
    for i, (policy, algorithm) in enumerate([
        ("solo", None), ("majority", None), ("two_choice", None), ("quorum:4", None),
        ("deadline", None), ("backup:1", None), (None, "rna")])
    for j, d in enumerate(("float32", "float64"))]
#: the optimizer's synchronous ones (an allreduce over the job's communicator): a loss ends them
OPTIMIZER_ENDS = [("sync", None, "float32"), (None, "odsgd", "float64")]
#: (policy, dtype, accumulate) of the DDP hook; its finish() is one broadcast whatever the policy
HOOK_CASES = [("majority", "float32", True), ("majority", "float64", True),
              ("solo", "float32", True), ("solo", "float64", True),
              ("deadline", "float64", True), ("backup:1", "float32", True),
              ("quorum:4", "float64", True), ("quorum:4", "float32", False)]
#: what the probe step's averaged gradient must be after the loss: the survivors' gradients
#: (rank + 1) summed and divided by the world the round spanned, 3 (by the job's 4 it would be
#: 1.5 with rank 3 lost: the divisor before averaging by the round's world)
PROBE = sum(r + 1 for r in range(4) if r != VICTIM) / SURVIVORS


def probe(label: str, model: Any, opt: Any, rank: int, ddp: bool) -> str | None:
    """One lockstep step of a quorum:4 case (every survivor in its round) with the gradient
    ``rank + 1`` everywhere; returns what differs from :data:`PROBE`, or None. The averaged
    gradient is read from ``.grad`` after the step (the optimizer wrapper hands it there to
    the inner optimizer) or after the backward pass (DDP writes the hook's result there)."""
    import torch

    dtype = next(model.parameters()).dtype
    opt.zero_grad()
    if ddp:  # DDP's forward must run for its hook to reduce the backward's buckets
        out = model(torch.zeros(1, 13, dtype=dtype)).sum() * 0
        (out + (rank + 1) * sum(p.sum() for p in model.parameters())).backward()
    else:
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
    if not ddp:
        opt.step()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if ddp:
        opt.step()
    if bool((got == PROBE).all()):
        return None
    return f"DIVISOR {label} {sorted(set(got.tolist()))[:4]} want {PROBE}"


def torch_part() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asynccoll.torch import DistributedOptimizer, partial_hook

    torch.set_num_threads(1)
    with asynccoll.init(collective_timeout=60) as comm:
        assert comm.comm.survive, "run under asynccoll run --max-failures 1"
        rank = comm.rank
        cases: list[Case] = []
        models: dict[str, Any] = {}

        def optimizer(label: str, policy: str | None, algorithm: str | None, d: str,
                      accumulate: bool = True) -> Any:
            torch.manual_seed(rank)  # replicas start apart: the wrapper broadcasts
            models[label] = torch.nn.Linear(13, 3).to(getattr(torch, d))
            return DistributedOptimizer(torch.optim.SGD(models[label].parameters(), lr=0.05),
                                        comm, policy, algorithm=algorithm, name=label,
                                        accumulate=accumulate)

        for policy, algorithm, d, average in OPTIMIZER_CASES:
            label = f"DistributedOptimizer {algorithm or policy} {d} average={average}"
            cases.append(Case(label, optimizer(label, policy, algorithm, d), average))
        label = "DistributedOptimizer quorum:4 float64 latest average=True"
        cases.append(Case(label, optimizer(label, "quorum:4", None, "float64", False)))
        for policy, algorithm, d in OPTIMIZER_ENDS:
            label = f"DistributedOptimizer {algorithm or policy} {d}"
            cases.append(Case(label, optimizer(label, policy, algorithm, d), ends=True))
        dist.init_process_group("gloo")
        for policy, d, accumulate in HOOK_CASES:
            label = f"partial_hook {policy} {d}" + ("" if accumulate else " latest")
            torch.manual_seed(0)
            models[label] = ddp = DDP(torch.nn.Sequential(
                torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(
                    getattr(torch, d)))
            state, hook = partial_hook(comm, policy, accumulate=accumulate, name=label)
            ddp.register_comm_hook(state, hook)
            cases.append(Case(label, (state, torch.optim.SGD(ddp.parameters(), lr=0.05))))
        rng = np.random.default_rng(rank)
        gen = torch.Generator().manual_seed(rank)
        comm.barrier()  # started together (numpy_part)
        for step in range(STEPS):
            jitter(rng)
            for i, c in enumerate(cases):
                die_here(rank, step, i, cases)
                if c.ended is not None:
                    continue
                model = models[c.label]
                opt = c.opt[1] if isinstance(c.opt, tuple) else c.opt
                dtype = next(model.parameters()).dtype
                c.last_ok = c.last_ok or time.monotonic()
                try:
                    opt.zero_grad()
                    model(torch.randn(4, 13, generator=gen, dtype=dtype)).square().mean(
                        ).backward()
                    opt.step()
                except PeerLostError as exc:
                    ended(c, exc)
                c.last_ok = time.monotonic()
        bad: list[str] = []
        for c in cases:  # after the loss: the averaged gradient divided by the 3 survivors
            if "quorum:4" in c.label and c.ended is None:
                opt = c.opt[1] if isinstance(c.opt, tuple) else c.opt
                wrong = probe(c.label, models[c.label], opt, rank, isinstance(c.opt, tuple))
                if wrong is not None:
                    bad.append(wrong)
        survivors: Any = None
        for c in cases:
            if c.ended is not None:
                continue
            if isinstance(c.opt, tuple):
                state, opt = c.opt
                state.finish(opt)
                handles = list(state._handles.values())
            else:
                c.opt.finish(average=c.average)
                handles = [c.opt._h]
            survivors = survivors or handles[0].communicator
            sizes = {h.world_size for h in handles}
            if sizes != {SURVIVORS}:
                bad.append(f"WORLD {c.label} {sorted(sizes)}")
        for c in cases:
            if c.ended is not None:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in models[c.label].parameters()])
            everyone = survivors.blocking.allgather(flat.numpy().view(np.uint8))
            if any(bytes(row) != bytes(everyone[0]) for row in everyone):
                bad.append(f"DIFFER {c.label}")
        report(survivors.rank, bad, cases)
        sys.stdout.flush()
        os._exit(0)  # gloo and the world communicator hold the lost rank: nothing to close


def main() -> None:
    part = sys.argv[1]
    if part == "torch":
        try:
            torch_part()
        except BaseException:  # the launcher keeps one line of a rank that fails after another
            import traceback
            print("TRACEBACK " + traceback.format_exc(), flush=True)
            raise
    else:
        asyncio.run(numpy_part() if part == "numpy" else sync_part())


if __name__ == "__main__":
    main()
