"""Join the job: start (or reach) the store, exchange transport addresses, connect every peer.

:func:`rendezvous` is what ``asynccoll.connect()`` calls with the :class:`JobSpec` of
:func:`asynccoll.launch.env.resolve`. It is collective: the n-th call of each rank meets the
n-th call of every other rank (its *generation*, counted per process, store address and rank, so
a job may connect, close and connect again). Store keys live under ``asynccoll/rdzv/GEN/``:

* ``claim/R`` — a counter each process bumps for its rank: two processes claiming one rank fail;
* ``world`` — the first rank's world size: a rank that disagrees fails, naming both sizes;
* ``salt`` — 32 random bytes, the first writer's. The transports authenticate with
  ``HMAC(job secret, label | salt)``, not the job secret itself, so each job gets a fresh
  transport key while the secret never leaves the host;
* ``addr/R`` — rank R's transport address;
* ``done/R``, ``left/R`` — the closing barrier: every rank has connected; every rank has
  finished with the store (only then may a store hosted by rank 0 stop).

Under torchrun (``spec.store_via == "torchrun"``) rank 0 runs the store on a free port and
publishes ``host:port`` in torchrun's agent store under ``asynccoll/store/RUN_ID/RESTART/GEN``,
where the other ranks wait for it (:mod:`.env`, *Under torchrun*).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
from typing import Any

from ..errors import PeerLostError, RendezvousError, RendezvousTimeoutError
from ..transport.base import Transport
from ..transport.registry import make_transport
from .env import JobSpec, listen_host
from .store import StoreClient, StoreServer, StoreTimeoutError

__all__ = ["RendezvousError", "RendezvousTimeoutError", "rendezvous", "transport_secret"]

PREFIX = "asynccoll/rdzv/"
_TRANSPORT_LABEL = b"asynccoll-transport-key-v1"


def transport_secret(secret: bytes, salt: bytes) -> bytes:
    """The key the transports of one job authenticate with (see the module doc)."""
    return hmac.new(secret, _TRANSPORT_LABEL + salt, hashlib.sha256).digest()


#: (store host, port, rank) -> rendezvous calls of that rank in this process
_generations: dict[tuple[str, int, int], int] = {}


async def rendezvous(spec: JobSpec, *, transport: str | None = None, timeout: float = 60.0,
                     transport_options: dict[str, Any] | None = None,
                     generation: int | None = None) -> Transport:
    """Create this rank's transport, connected to every other rank; return it.

    ``transport``: the scheme (default ``spec.transport``); ``transport_options``: extra keyword
    arguments for the transport class (``limits``, ...). ``generation``: which collective call
    this is (default: this process's count of calls at this store). Runs the store for the job when
    ``spec.host_store`` and stops it once every rank is done with it. The transport listens on
    :func:`~asynccoll.launch.env.listen_host` at a free port.

    Raises :class:`RendezvousTimeoutError` naming the ranks that did not arrive within
    ``timeout`` seconds, :class:`RendezvousError` on a duplicate rank, a world-size mismatch or
    a store address rank 0 cannot bind, :class:`~asynccoll.AuthenticationError` when the store
    does not share the secret. Nothing is left running on failure.
    """
    scheme = transport or spec.transport
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def left() -> float:
        return max(deadline - loop.time(), 0.001)

    options = dict(transport_options or {})
    rank, world, cap = spec.rank, spec.world_size, spec.capacity
    if cap == 1:
        salt = secrets.token_bytes(32)
        t1 = _make(scheme, rank, world, transport_secret(spec.secret, salt), options)
        try:
            await t1.listen(_listen_address(scheme, spec, salt))
            await t1.connect({}, timeout=left())
        except BaseException:
            await t1.close()
            raise
        return t1
    if spec.store is None:
        raise RendezvousError(f"a world of {world} ranks needs a store address")
    host, port = spec.store
    if spec.restart or spec.grows:
        return await _rejoin(spec, scheme, options, left)
    if generation is None:
        gkey = (host, port, rank)
        generation = _generations.get(gkey, 0)
        _generations[gkey] = generation + 1
    prefix = f"{PREFIX}{generation}/"
    server: StoreServer | None = None
    client: StoreClient | None = None
    t: Transport | None = None
    via = spec.store_via == "torchrun"
    try:
        if spec.host_store:
            try:
                server = await StoreServer(host, 0 if via else port, spec.secret).start()
            except OSError as exc:
                raise RendezvousError(
                    f"rank {rank} cannot run the store at {host}:{0 if via else port}: {exc}; "
                    "choose a free address with ASYNCCOLL_STORE=host:port") from exc
            if via:
                await asyncio.to_thread(_torchrun_store, host, port, _torchrun_key(generation),
                                        left(), str(server.port))
                port = server.port
        elif via:
            port = int(await asyncio.to_thread(_torchrun_store, host, port,
                                               _torchrun_key(generation), left()))
        client = await StoreClient.connect(host, port, spec.secret, timeout=left())
        claims = await client.add(f"{prefix}claim/{rank}", 1)
        if claims > 1:
            raise RendezvousError(f"rank {rank} is claimed by {claims} processes; each rank "
                                  "must be started once (check the rank variables)")
        size = _world_text(spec)
        agreed = await client.compare_set(f"{prefix}world", None, size.encode())
        if agreed != size.encode():
            reason = (f"rank {rank} has world size {size} but the job's first rank has "
                      f"{agreed.decode(errors='replace') if agreed else agreed}")
            # Tell the ranks already waiting, so they fail now instead of at their timeout.
            with contextlib.suppress(Exception):
                await client.set(f"{prefix}abort", reason.encode(), timeout=left())
            raise RendezvousError(reason)
        job_salt = await client.compare_set(f"{prefix}salt", None, secrets.token_bytes(32))
        assert job_salt is not None
        t = _make(scheme, rank, cap, transport_secret(spec.secret, job_salt), options)
        address = await t.listen(_listen_address(scheme, spec, job_salt))
        await client.set(f"{prefix}addr/{rank}", address.encode())
        keys = [f"{prefix}addr/{r}" for r in range(world)]
        await _wait(client, keys, left(), "publish its transport address", prefix)
        values = await asyncio.gather(*(client.get(k, timeout=left()) for k in keys))
        peers = {r: v.decode() for r, v in enumerate(values) if r != rank}
        if scheme == "inproc":
            try:
                _same_process(peers, rank)
            except RendezvousError as exc:
                with contextlib.suppress(Exception):  # tell the others before the store goes
                    await client.set(f"{prefix}abort", str(exc).encode(), timeout=left())
                raise
        await t.connect(peers, timeout=left())
        await client.set(f"{prefix}done/{rank}", b"1")
        await _wait(client, [f"{prefix}done/{r}" for r in range(world)], left(),
                    "connect to its peers", prefix)
        # a job that may grow: the ranks above the first world are vacant until a process
        # takes one (it joins as a restarted rank does: _rejoin), admitted from now on
        if cap > world:
            t.admit_rejoins = True
            t.vacate(range(world, cap))
        if server is None:
            await client.set(f"{prefix}left/{rank}", b"1")
        else:
            await _wait(client, [f"{prefix}left/{r}" for r in range(world) if r != rank],
                        left(), "finish with the store", prefix)
        return t
    except BaseException:
        if t is not None:
            with contextlib.suppress(Exception):
                await t.close()
        raise
    finally:
        if client is not None:
            await client.close()
        if server is not None:
            await server.close()


#: how many times, and how often, a restarted process reads again the addresses of the peers
#: it could not reach (one restarting at the same time publishes its new one meanwhile)
REJOIN_REREADS = 6
REJOIN_REREAD_S = 0.5


async def _rejoin(spec: JobSpec, scheme: str, options: dict[str, Any],
                  left: Any) -> Transport:
    """A restarted process (``spec.restart`` > 0) takes its rank's place in the running job,
    and a process given a vacant rank of a job that may grow (``spec.grows``) takes that:
    it claims the rank's restart in the store (``rejoin/R/K``: two processes claiming one
    restart fail), learns the job's salt and the members' addresses from the first
    generation's keys (those of the vacant ranks that a process holds now), publishes its own
    address (a member restarted later dials it), and dials every member
    (:meth:`~asynccoll.transport.base.Transport.rejoin`). The members admit it only if they
    lost (or never had) the rank and admit rejoins; the handles take it back later
    (:mod:`asynccoll.comm.joining`)."""
    assert spec.store is not None
    host, port = spec.store
    prefix = f"{PREFIX}0/"
    rank, world, cap = spec.rank, spec.world_size, spec.capacity
    who = (f"rank {rank} was restarted (ASYNCCOLL_RESTART={spec.restart})" if spec.restart
           else f"rank {rank} (a vacant rank of a job of {world} up to {cap}) joins")
    client = await StoreClient.connect(host, port, spec.secret, timeout=left())
    t: Transport | None = None
    try:
        claims = await client.add(f"{prefix}rejoin/{rank}/{spec.restart}", 1)
        if claims > 1:
            raise RendezvousError(f"restart {spec.restart} of rank {rank} is claimed by "
                                  f"{claims} processes")
        try:
            salt = await client.get(f"{prefix}salt", timeout=left())
            size = await client.get(f"{prefix}world", timeout=left())
        except StoreTimeoutError as exc:
            raise RendezvousTimeoutError(f"{who} but the job never started", [0]) from exc
        mine = _world_text(spec)
        if size != mine.encode():
            raise RendezvousError(f"{who} with world size {mine} but the job has "
                                  f"{size.decode(errors='replace')}")
        t = _make(scheme, rank, cap, transport_secret(spec.secret, salt), options)
        t.admit_rejoins = True
        t.incarnation = spec.restart  # in the handshake: notices about older processes drop
        address = await t.listen(_listen_address(scheme, spec, salt))
        await client.set(f"{prefix}addr/{rank}", address.encode())
        # the first world's ranks, and the vacant ones that a process took (published its
        # address: one taking it after this read dials this rank)
        vacant = [r for r in range(world, cap) if r != rank]
        published = await asyncio.gather(*(client.check([f"{prefix}addr/{r}"],
                                                         timeout=left()) for r in vacant))
        held = [r for r, ok in zip(vacant, published, strict=True) if ok]
        others = [r for r in range(world) if r != rank] + held

        async def addresses(ranks: list[int]) -> dict[int, str]:
            got = await asyncio.gather(*(client.get(f"{prefix}addr/{r}", timeout=left())
                                         for r in ranks))
            return {r: v.decode() for r, v in zip(ranks, got, strict=True)}

        peers = await addresses(others)
        try:
            reached = set(await t.rejoin(peers, timeout=left()))
        except PeerLostError as exc:
            raise RendezvousError(
                f"{who} but no other rank of the job took it back: the job has ended, or "
                f"every other rank is lost ({exc.reason})") from exc
        # A peer restarting at the same time may have published its new address after we
        # read the old one (nobody listened there): read again a few times, dial what changed.
        # A peer truly gone costs these few reads; when it comes back it dials us.
        for _ in range(REJOIN_REREADS):
            missing = [r for r in others if r not in reached]
            if not missing:
                break
            await asyncio.sleep(REJOIN_REREAD_S)
            fresh = await addresses(missing)
            changed = {r: a for r, a in fresh.items() if a != peers[r]}
            peers.update(changed)
            if changed:
                with contextlib.suppress(PeerLostError):
                    reached |= set(await t.rejoin(changed, timeout=min(left(), 10.0)))
        # the vacant ranks nobody holds yet: as on every member (a process that takes one
        # later dials this rank)
        t.vacate(r for r in range(world, cap) if r != rank and r not in peers)
        return t
    except BaseException:
        if t is not None:
            with contextlib.suppress(Exception):
                await t.close()
        raise
    finally:
        await client.close()


def _world_text(spec: JobSpec) -> str:
    """The job's size as the store keeps it (``world``): ``"4"``, or ``"2 (up to 4)"`` for a
    job that may grow; every rank, and a rank that joins later, must say the same."""
    w, cap = spec.world_size, spec.capacity
    return str(w) if cap == w else f"{w} (up to {cap})"


async def _wait(client: StoreClient, keys: list[str], timeout: float, what: str,
                prefix: str) -> None:
    """Wait for ``keys``, unless a rank aborts the rendezvous first (``prefix + "abort"``)."""
    waiting = asyncio.ensure_future(client.wait(keys, timeout))
    abort = asyncio.ensure_future(client.get(f"{prefix}abort", timeout=timeout))
    try:
        await asyncio.wait((waiting, abort), return_when=asyncio.FIRST_COMPLETED)
        if abort.done() and not abort.cancelled() and abort.exception() is None:
            raise RendezvousError(f"the rendezvous was aborted: {abort.result().decode()}")
        await waiting
    except StoreTimeoutError as exc:
        missing = sorted(int(k.rsplit("/", 1)[1]) for k in exc.missing)
        raise RendezvousTimeoutError(
            f"ranks {missing} did not {what} within the rendezvous timeout", missing) from exc
    finally:
        for f in (waiting, abort):
            if not f.done():
                f.cancel()
        await asyncio.gather(waiting, abort, return_exceptions=True)


def _torchrun_key(generation: int) -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"asynccoll/store/{run}/{restart}/{generation}"


def _torchrun_store(host: str, port: int, key: str, timeout: float,
                    value: str | None = None) -> str:
    """Set ``key`` to ``value`` in torchrun's agent store at ``host:port``, or (``value``
    None) wait up to ``timeout`` seconds for it and return it. Blocking: run it in a thread.
    Raises RendezvousTimeoutError when the key does not appear (rank 0 did not publish),
    RendezvousError when torchrun's store cannot be reached."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                              timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"cannot reach torchrun's store at {host}:{port} (MASTER_ADDR, "
                              f"MASTER_PORT) to learn where asynccoll's store runs: {exc}"
                              ) from exc
    if value is not None:
        store.set(key, value)
        return value
    try:
        return bytes(store.get(key)).decode()
    except (RuntimeError, OSError) as exc:
        raise RendezvousTimeoutError(
            f"rank 0 did not publish asynccoll's store address in torchrun's store within "
            f"{timeout:.0f} s ({exc})", [0]) from exc


def _make(scheme: str, rank: int, world: int, key: bytes, options: dict[str, Any]) -> Transport:
    if scheme == "inproc":  # ranks in one process: nothing to authenticate
        t: Transport = make_transport(scheme, rank, world, **options)
    else:
        t = make_transport(scheme, rank, world, secret=key, **options)
    return t


def _same_process(peers: dict[int, str], rank: int) -> None:
    """inproc connects the ranks of one process only: refuse at once, naming the ranks that
    run elsewhere, instead of waiting out the timeout for endpoints that cannot appear."""
    mine = f"-pid{os.getpid()}/"
    away = sorted(r for r, a in peers.items() if mine not in a)
    if away:
        raise RendezvousError(f"rank {rank}: transport 'inproc' connects ranks of one process "
                              f"only, and ranks {away} run in other processes; use tcp or ucx")


def _listen_address(scheme: str, spec: JobSpec, salt: bytes) -> str:
    if scheme == "inproc":  # the in-process ranks of one job share a fabric named by its salt
        # (and the process, so that ranks in other processes are told at once, not timed out)
        return f"inproc://rdzv-{salt.hex()[:16]}-pid{os.getpid()}/{spec.rank}"
    host = listen_host(spec)
    return f"{scheme}://[{host}]:0" if ":" in host else f"{scheme}://{host}:0"
