"""A small convex problem (least squares per rank) and a driver running P ranks' loops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

P, D, M = 4, 12, 32


class Problem:
    """Rank r minimises ``|A_r w - b_r|^2 / (2M)``; the global loss is the mean over ranks."""

    def __init__(self, seed: int = 0, world: int = P) -> None:
        rng = np.random.default_rng(seed)
        self.world = world
        self.A = rng.standard_normal((world, M, D))
        w_true = rng.standard_normal(D)
        self.b = self.A @ w_true + 0.1 * rng.standard_normal((world, M))
        self.w0 = np.zeros(D)
        A = self.A.reshape(-1, D)
        self.w_star = np.linalg.lstsq(A, self.b.reshape(-1), rcond=None)[0]

    def grad(self, r: int, w: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.A[r].T @ (self.A[r] @ w - self.b[r]) / M
        return out

    def mean_grad(self, w: np.ndarray) -> np.ndarray:
        return np.mean([self.grad(r, w) for r in range(self.world)], axis=0)

    def loss(self, w: np.ndarray) -> float:
        res = self.A @ w - self.b
        return float(np.mean(res * res) / 2)

    def excess(self, w: np.ndarray) -> float:
        """Excess loss relative to the start: 1 at w0, 0 at the optimum."""
        return (self.loss(w) - self.loss(self.w_star)) / (self.loss(self.w0)
                                                          - self.loss(self.w_star))

    def sync_sgd(self, lr: float, steps: int) -> np.ndarray:
        w = self.w0.copy()
        for _ in range(steps):
            w -= lr * self.mean_grad(w)
        return w


async def run_ranks(comms: list[Any], make: Callable[[Any, np.ndarray], Any], prob: Problem,
                    steps: int, *, delay: Callable[[int, int], float] | None = None,
                    aligned: bool = False, finish: Callable[[Any], Any] | None = None,
                    timeout: float = 60.0) -> list[tuple[Any, np.ndarray, list[Any]]]:
    """Run every rank's loop concurrently; return (optimizer, final params, infos) per rank.

    ``aligned``: all ranks start each step together (an asyncio barrier), so with an inline
    progress engine every rank hands in its gradient before any message is processed.
    """
    barrier = asyncio.Barrier(len(comms)) if aligned else None

    async def rank(r: int) -> tuple[Any, np.ndarray, list[Any]]:
        opt = make(comms[r], prob.w0.copy())
        infos = []
        for s in range(steps):
            if delay is not None:
                d = delay(r, s)
                if d:
                    await asyncio.sleep(d)
            if barrier is not None:
                await barrier.wait()
            infos.append(await opt.step(prob.grad(r, opt.params)))
        if finish is None:
            await opt.finish()
        else:
            await finish(opt)
        return opt, opt.params.copy(), infos

    return list(await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(len(comms)))),
                                       timeout))


def one_random_rank(seed: int, d: float, world: int = P) -> Callable[[int, int], float]:
    """Delay ``d`` seconds for one rank per step, the same seeded choice on every rank."""
    def delay(r: int, s: int) -> float:
        return d if int(np.random.default_rng((seed, s)).integers(world)) == r else 0.0
    return delay
