"""The launchers of a multi-node job in the store: how they meet, replace one another, check out.

Every launcher holds a *lease* on ``asynccoll/launch/launcher/K`` (K: its node rank) for as long
as it lives (:meth:`StoreClient.lease`: the store deletes the key when the launcher's
connection closes, which the kernel does when the launcher dies, ``SIGKILL`` included). So:

* a second launcher of a node whose launcher is alive is refused ("started twice");
* a launcher of a node whose launcher is gone is a *replacement*: it joins the running job
  at once (the meeting of the launchers already happened), its restart is counted against the
  node's ``--max-restarts`` (kept in the store, so that rank restarts and replacements share
  it), and it starts the node's ranks with ``ASYNCCOLL_RESTART`` set (one restart of the node,
  whatever its number of ranks). A node that already checked out cannot be started again;
* node 0's launcher follows every other node (:func:`follow`): a node whose launcher is gone
  is waited for, up to ``join_timeout``, while its restarts allow a replacement, and is given
  up otherwise; either way the job goes on (whether the other ranks survive the loss is theirs
  to decide: ``ASYNCCOLL_MAX_FAILURES``). Its exit barrier (:func:`check_out`) waits for the
  nodes still followed, never for one given up.

Node 0 cannot be replaced: its launcher hosts the store, and the store dies with it. The other
launchers say so, restart nothing from then on, and keep trying the store's address
(:func:`tell_new_store`): a new node 0 launcher started there with the job's secret learns from
them at once, at its meeting, that it cannot take the job over, and fails with that reason
instead of waiting ``join_timeout`` for nodes that already run. A host that vanishes without
closing its connections (power loss) is noticed only when its TCP connection times out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..errors import AuthenticationError
from .store import StoreClient, StoreError, StoreServer, StoreTimeoutError


class LaunchConfig(Protocol):
    """What this module uses of :class:`.runner.LaunchConfig` (named by shape: the runner
    imports this module)."""

    @property
    def nnodes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def node_limit(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def rdzv(self) -> tuple[str, int] | None: ...
    @property
    def secret(self) -> bytes: ...
    @property
    def max_restarts(self) -> int: ...
    @property
    def join_timeout(self) -> float: ...
    @property
    def exit_timeout(self) -> float: ...

__all__ = ["check_out", "follow", "follow_joining", "join", "joined_nodes", "rank_starts",
           "spend_restart", "tell_new_store"]

#: how many launchers took node K (a counter: > 1 means a replacement)
NODE_KEY = "asynccoll/launch/node/"
#: the lease of node K's live launcher
LAUNCHER_KEY = "asynccoll/launch/launcher/"
#: set by node K's launcher once its ranks are done
EXIT_KEY = "asynccoll/launch/exit/"
#: restarts node K made (of ranks, and of the node by a replacement launcher)
RESTARTS_KEY = "asynccoll/launch/restarts/node/"
#: how many times rank R was started
STARTS_KEY = "asynccoll/launch/starts/rank/"
SHAPE_KEY = "asynccoll/launch/shape"
#: set in a new store, by a launcher whose job's store died, to tell a new node 0 why not
ORPHAN_KEY = "asynccoll/launch/orphaned"
#: how long a new launcher waits for a lost one's lease to go before calling it a duplicate:
#: the store learns of a death when it reads the dead connection's end, a moment later
LEASE_GRACE_S = 2.0
FOREVER = float(1 << 31)

Say = Callable[[str], None]


def node_ranks(cfg: LaunchConfig, node: int) -> str:
    """``"ranks 2-3"`` (``"rank 2"``): the ranks of ``node``, for messages."""
    first, last = node * cfg.nproc, (node + 1) * cfg.nproc - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def nodes(keys: Sequence[str]) -> list[int]:
    return sorted(int(k.rsplit("/", 1)[1]) for k in keys)


async def join(cfg: LaunchConfig, store: tuple[str, int], server: StoreServer | None,
               say: Say) -> tuple[StoreClient, int]:
    """Check in with the job's store: it shares our secret, our node rank is not taken by a
    live launcher and every node runs the same number of ranks. Returns the client and the
    node's restart number (0: a first start; n: this launcher replaces a lost one, the node's
    n-th restart). A launcher whose secret is wrong learns it from the store's refusal and
    fails at once. ``server`` (node 0, which hosts the store): refusals decide nothing (a
    stranger's bad frame looks like a wrong secret), so node 0 keeps waiting for its nodes and
    says, at doubling intervals from 5 s, how many connections the store refused and from
    where; the join timeout's error says it too. Raises :class:`StoreError` (with the reason)
    for a duplicate, a node that already finished, a replacement past ``--max-restarts`` or a
    different shape."""
    client = await StoreClient.connect(store[0], store[1], cfg.secret,
                                       timeout=cfg.join_timeout)
    try:
        await _take_lease(cfg, client)
        nn = str(cfg.nnodes) if cfg.node_limit == cfg.nnodes \
            else f"{cfg.nnodes}:{cfg.node_limit}"
        mine = f"{nn}x{cfg.nproc}".encode()
        agreed = await client.compare_set(SHAPE_KEY, None, mine)
        if agreed != mine:
            raise StoreError(f"this node runs --nnodes {nn} with -n {cfg.nproc}, but "
                             f"the first node to join said {agreed!r} (nnodes x nproc)")
        restart = 0
        if await client.add(f"{NODE_KEY}{cfg.node_rank}", 1) > 1:
            restart = await client.add(f"{RESTARTS_KEY}{cfg.node_rank}", 1)
            if restart > cfg.max_restarts:
                raise StoreError(
                    f"node rank {cfg.node_rank} lost its launcher, and replacing it would be "
                    f"its restart {restart}, past --max-restarts {cfg.max_restarts}")
        await _meet(cfg, client, server, say)
    except BaseException:
        await client.close()
        raise
    return client, restart


async def _take_lease(cfg: LaunchConfig, client: StoreClient) -> None:
    """Hold node ``cfg.node_rank``'s launcher lease, or raise: another launcher of it lives,
    or the node already finished."""
    key = f"{LAUNCHER_KEY}{cfg.node_rank}"
    me = f"pid {os.getpid()} on {socket.gethostname()} ({secrets.token_hex(4)})".encode()
    held = await client.lease(key, me)
    if held != me:
        with contextlib.suppress(StoreTimeoutError):
            await client.wait_gone(key, min(LEASE_GRACE_S, cfg.join_timeout))
        held = await client.lease(key, me)
    if held != me:
        raise StoreError(f"node rank {cfg.node_rank} was started twice (its launcher, "
                         f"{held.decode(errors='replace')}, is running)")
    if await client.check([f"{EXIT_KEY}{cfg.node_rank}"]):
        raise StoreError(f"node rank {cfg.node_rank} already finished its ranks in this job; "
                         "there is nothing to replace")


async def _meet(cfg: LaunchConfig, client: StoreClient, server: StoreServer | None,
                say: Say) -> None:
    """Wait until every node has joined once (at once for a replacement: they have)."""
    keys = [f"{NODE_KEY}{k}" for k in range(cfg.nnodes)]
    waiting = asyncio.ensure_future(client.wait(keys, cfg.join_timeout))
    orphaned = asyncio.ensure_future(client.get(ORPHAN_KEY, timeout=cfg.join_timeout)
                                     if server is not None else asyncio.Future())
    said, every = 0, 5.0
    try:
        while not (await asyncio.wait({waiting, orphaned}, timeout=every,
                                      return_when=asyncio.FIRST_COMPLETED))[0]:
            every *= 2
            refused = sum(server.refusals.values()) if server is not None else 0
            if refused > said:
                said = refused
                say(f"still waiting for the other nodes; the store refused "
                    f"{server.refusal_summary() if server else refused} "
                    "(wrong secret or not asynccoll)")
        if not waiting.done() and orphaned.done() and orphaned.exception() is None:
            raise StoreError(
                f"{orphaned.result().decode(errors='replace')}; node 0 cannot be replaced "
                "(its launcher hosted the job's store, which died with it: docs/launch.md, "
                "Restarts): stop the job's other launchers and start the job again")
        await waiting
    except StoreTimeoutError as exc:
        why = ""
        if server is not None and server.refusals:
            why = (f"; the store refused {server.refusal_summary()}: is the same job "
                   "secret set on every node?")
        raise StoreError(f"nodes {nodes(exc.missing)} did not join within "
                         f"{cfg.join_timeout} s{why}") from exc
    finally:
        for w in (waiting, orphaned):
            w.cancel()
        await asyncio.gather(waiting, orphaned, return_exceptions=True)


async def spend_restart(cfg: LaunchConfig, client: StoreClient | None, spent: int) -> int:
    """Count one more restart of this node and return the node's restarts so far (``spent``:
    the count this launcher knows, used without a store client)."""
    if client is None:
        return spent + 1
    return await client.add(f"{RESTARTS_KEY}{cfg.node_rank}", 1)


async def rank_starts(client: StoreClient | None, rank: int, known: int) -> int:
    """Count one more start of ``rank`` and return its starts so far (``known``: the count
    this launcher knows, used without a store client); a replacement launcher learns the
    starts its predecessor made from the store."""
    if client is None:
        return known + 1
    return await client.add(f"{STARTS_KEY}{rank}", 1)


async def follow(cfg: LaunchConfig, client: StoreClient, node: int, say: Say) -> None:
    """Node 0: return once node ``node`` is done: its launcher checked out, or it is gone and
    no launcher replaced it (its restarts are spent, or none came within ``join_timeout``).
    Says one line per event. Costs two blocked store requests."""
    lease, done = f"{LAUNCHER_KEY}{node}", f"{EXIT_KEY}{node}"
    while True:
        waits = {asyncio.ensure_future(client.get(done, timeout=FOREVER)),
                 asyncio.ensure_future(client.wait_gone(lease, FOREVER))}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if await client.check([done]):
            return
        spent = await client.add(f"{RESTARTS_KEY}{node}", 0)
        if spent >= cfg.max_restarts:
            say(f"node {node}'s launcher is gone, and {node_ranks(cfg, node)} with it; it "
                f"cannot be replaced ({spent} of at most {cfg.max_restarts} restarts made, "
                "--max-restarts): the other nodes go on without it")
            return
        say(f"node {node}'s launcher is gone, and {node_ranks(cfg, node)} with it; waiting "
            f"up to {cfg.join_timeout} s for a launcher to replace it (--max-restarts)")
        try:
            await client.wait([lease], cfg.join_timeout)
        except StoreTimeoutError:
            say(f"no launcher replaced node {node} within {cfg.join_timeout} s: its ranks are "
                "lost for good")
            return
        say(f"node {node} has a new launcher: it restarts {node_ranks(cfg, node)}")


async def follow_joining(cfg: LaunchConfig, client: StoreClient, node: int, say: Say) -> None:
    """Node 0, for a node the job may grow by (``--nnodes MIN:MAX``): once its launcher
    joined, say so and :func:`follow` it; runs until then or until cancelled."""
    await client.wait([f"{NODE_KEY}{node}"], FOREVER)
    say(f"node {node} joined the running job: {node_ranks(cfg, node)} are taken in at the "
        "members' next sync event")
    await follow(cfg, client, node, say)


async def joined_nodes(client: StoreClient, candidates: Sequence[int]) -> list[int]:
    """Those of ``candidates`` (nodes the job may grow by) whose launcher joined."""
    return [k for k in candidates if await client.check([f"{NODE_KEY}{k}"])]


async def check_out(cfg: LaunchConfig, client: StoreClient,
                    followed: Mapping[int, asyncio.Task[None]], say: Say) -> None:
    """The exit barrier: node 0 keeps the store up until every node's ranks are done (ranks of
    a job that does not rendezvous may finish at very different times), or until a node is
    given up (:func:`follow`), at most ``exit_timeout``."""
    with contextlib.suppress(StoreError):
        await client.set(f"{EXIT_KEY}{cfg.node_rank}", b"1", timeout=5.0)
    if cfg.node_rank != 0 or not followed:
        return
    _, pending = await asyncio.wait(followed.values(), timeout=cfg.exit_timeout)
    if pending:
        left = sorted(k for k, t in followed.items() if t in pending)
        say(f"nodes {left} still running after {cfg.exit_timeout} s; closing the store")


async def tell_new_store(cfg: LaunchConfig) -> None:
    """A launcher that lost its job's store: keep trying the store's address, and tell a store
    that comes up there with the job's secret (a new node 0 launcher) that this node still
    runs the old job's ranks (:data:`ORPHAN_KEY`). Runs until told or cancelled; gives up only
    on a store that refuses the secret (another job's).

    A connection the store closes, or a handshake or request that times out, is tried again:
    the first dial can reach the dying launcher's listening socket after its connections are
    gone, and be reset (one CI run in a few under load told no one, and the new node 0 waited
    out its join timeout)."""
    assert cfg.rdzv is not None
    message = (f"node {cfg.node_rank}'s launcher (pid {os.getpid()} on {socket.gethostname()}) "
               f"still runs {node_ranks(cfg, cfg.node_rank)} of the job whose store died with "
               "the last node 0").encode()
    delay = 0.05
    while True:
        try:
            client = await StoreClient.connect(*cfg.rdzv, cfg.secret, timeout=5.0,
                                               connect_timeout=FOREVER)
            try:
                await client.set(ORPHAN_KEY, message)
                return
            finally:
                await client.close()
        except AuthenticationError:
            return
        except (StoreError, OSError):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
