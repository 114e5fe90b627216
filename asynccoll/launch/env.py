"""Who am I in the job: rank, world size, store address, secret, transport, listen address.

:func:`resolve` reads, in this order of precedence (the first source that sets a rank decides
the rank and the world size; the other settings fall through the chain one by one):

1. explicit arguments (``resolve(rank=, world_size=, store=, ...)``);
2. ``ASYNCCOLL_RANK`` / ``ASYNCCOLL_WORLD_SIZE`` / ``ASYNCCOLL_STORE`` (set by ``asynccoll run``);
3. torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``;
4. SLURM's ``SLURM_PROCID`` / ``SLURM_NTASKS`` plus a store address from 1-3.

A half-given source (``RANK`` without ``WORLD_SIZE``), a value that does not parse, or one that
contradicts another (rank outside the world) raises :class:`ConfigError` naming the variable.
``ASYNCCOLL_MAX_WORLD_SIZE`` (``asynccoll run --nnodes MIN:MAX``) gives a job that may grow:
ranks from ``ASYNCCOLL_WORLD_SIZE`` up to it are vacant at the start, and a process given one
joins the running job (:attr:`JobSpec.grows`).

**Under torchrun** no port is guessed: torchrun's agent runs a store at ``MASTER_ADDR:MASTER_PORT``
for its workers (``TORCHELASTIC_USE_AGENT_STORE=True``, its default), so rank 0 starts
asynccoll's store on a free port of ``MASTER_ADDR`` and publishes the port in torchrun's store,
where the other ranks read it (:attr:`JobSpec.store_via` is ``"torchrun"``; torch is imported
for that). Binding ``MASTER_PORT + 1``, as this module once did, failed whenever torchrun's
random ``MASTER_PORT`` had a busy neighbour. Only when no agent store is shared
(``MASTER_ADDR``/``MASTER_PORT`` set by hand, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) does
the store listen at ``MASTER_PORT + 1``. ``ASYNCCOLL_STORE`` overrides both.

**The secret.** Store and transport connections prove knowledge of a shared job secret. No
launcher but ``asynccoll run`` hands one out, and none can be bootstrapped safely over the network
(whoever reaches the store's port would get it), so the secret comes from, in order: the
``secret`` argument; ``ASYNCCOLL_SECRET`` (at least 16 characters); the file named by
``ASYNCCOLL_SECRET_FILE``; the per-user key file ``$XDG_CONFIG_HOME/asynccoll/secret`` (default
``~/.config/asynccoll/secret``), created with mode 0600 on first use. The key file serves every
job of one user on one host, or on hosts that share the home directory; other multi-host jobs
must set ``ASYNCCOLL_SECRET`` (or ``ASYNCCOLL_SECRET_FILE``) to the same value on every host.
Key files readable by group or others are refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["ConfigError", "JobSpec", "free_port", "listen_host", "parse_hostport", "resolve",
           "say_if_alone", "torchrun_agent_store", "user_secret"]

#: the transport used when nothing says otherwise
DEFAULT_TRANSPORT = "tcp"
_TRANSPORTS = ("tcp", "ucx", "inproc")
MIN_SECRET = 16


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs to join its job.

    ``store`` is ``(host, port)`` or ``None`` for a world of one. ``host_store``: this process
    must run the store (rank 0, unless a launcher runs it). ``host``: the address to listen on,
    ``None`` to choose from the route to the store (see :func:`listen_host`). ``source`` says
    where rank and world size came from: ``"explicit"``, ``"asynccoll"``, ``"torchrun"``,
    ``"slurm"`` or ``"default"`` (a world of one). ``store_via``: ``"torchrun"`` when
    ``store`` is torchrun's agent store, in which rank 0 publishes where asynccoll's store
    listens (module doc); ``None`` when ``store`` is asynccoll's store itself.
    """

    rank: int
    world_size: int
    store: tuple[str, int] | None
    secret: bytes = field(repr=False)
    transport: str = DEFAULT_TRANSPORT
    local_rank: int | None = None
    local_world_size: int | None = None
    host: str | None = None
    host_store: bool = False
    source: str = "explicit"
    store_via: str | None = None
    #: how many times this rank was restarted (``ASYNCCOLL_RESTART``, set by ``asynccoll run
    #: --max-restarts``): above 0, the process takes a lost rank's place in a running job
    #: instead of meeting the others at the start (:func:`.rendezvous.rendezvous`)
    restart: int = 0
    #: the most ranks the job may grow to (``ASYNCCOLL_MAX_WORLD_SIZE``, set by ``asynccoll run
    #: --nnodes MIN:MAX``; None: ``world_size``, a job that only takes lost ranks back). Ranks
    #: ``world_size..max_world_size-1`` are *vacant* at the start: a process given one of them
    #: joins the running job as a restarted rank does (:attr:`grows`; docs/groups.md, "Growing")
    max_world_size: int | None = None

    @property
    def capacity(self) -> int:
        """The job's rank ids: ``max_world_size``, else ``world_size``."""
        return self.max_world_size or self.world_size

    @property
    def grows(self) -> bool:
        """Whether this process takes a vacant rank of a running job (its rank is at or above
        the world the job started with)."""
        return self.rank >= self.world_size


def _int(environ: Mapping[str, str], var: str, *, minimum: int) -> int | None:
    raw = environ.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(var, f"must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(var, f"must be >= {minimum}, got {value}")
    return value


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``; ConfigError naming ``what``.

    >>> parse_hostport("10.0.0.1:29500", "ASYNCCOLL_STORE")
    ('10.0.0.1', 29500)
    """
    if not isinstance(text, str):
        raise ConfigError(what, f"must be 'host:port', got {type(text).__name__}")
    host, sep, port_s = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ConfigError(what, f"must be 'host:port', got {text!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(what, f"port must be an integer, got {text!r}") from None
    if not 0 <= port < 65536:
        raise ConfigError(what, f"port must be in 0..65535, got {port}")
    return host, port


def _ranks(rank: int | None, world: int | None, environ: Mapping[str, str],
           ) -> tuple[int, int, str, str, str]:
    """(rank, world, source, rank variable, world variable)."""
    if rank is not None or world is not None:
        if rank is None or world is None:
            name = "rank" if rank is None else "world_size"
            raise ConfigError(name, "rank and world_size must be given together")
        return rank, world, "explicit", "rank", "world_size"
    for source, rvar, wvar in (("asynccoll", "ASYNCCOLL_RANK", "ASYNCCOLL_WORLD_SIZE"),
                               ("torchrun", "RANK", "WORLD_SIZE"),
                               ("slurm", "SLURM_PROCID", "SLURM_NTASKS")):
        r = _int(environ, rvar, minimum=0)
        w = _int(environ, wvar, minimum=1)
        if r is None and w is None:
            continue
        if r is None:
            raise ConfigError(rvar, f"is not set but {wvar}={w} is")
        if w is None:
            raise ConfigError(wvar, f"is not set but {rvar}={r} is")
        return r, w, source, rvar, wvar
    return 0, 1, "default", "ASYNCCOLL_RANK", "ASYNCCOLL_WORLD_SIZE"


def _store(store: str | tuple[str, int] | None,
           environ: Mapping[str, str]) -> tuple[str, int] | None:
    if store is not None:
        if isinstance(store, tuple):
            host, port = store
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ConfigError("store", f"port must be in 1..65535, got {port!r}")
            return str(host), port
        return parse_hostport(store, "store")
    if environ.get("ASYNCCOLL_STORE"):
        return parse_hostport(environ["ASYNCCOLL_STORE"], "ASYNCCOLL_STORE")
    addr, port_s = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr or port_s:
        if not addr:
            raise ConfigError("MASTER_ADDR", f"is not set but MASTER_PORT={port_s} is")
        p = _int(environ, "MASTER_PORT", minimum=1)
        if p is None:
            raise ConfigError("MASTER_PORT", f"is not set but MASTER_ADDR={addr} is")
        if torchrun_agent_store(environ):
            return addr, p
        if p >= 65535:
            raise ConfigError("MASTER_PORT", f"must be below 65535 (the store uses it + 1), "
                                             f"got {p}")
        return addr, p + 1
    return None


def torchrun_agent_store(environ: Mapping[str, str]) -> bool:
    """Whether torchrun's agent shares its store at ``MASTER_ADDR:MASTER_PORT`` with this
    process (torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` unless told not to)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not environ.get(
        "ASYNCCOLL_STORE")


def user_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    """The secret from ``ASYNCCOLL_SECRET_FILE`` or the per-user key file (created if absent).

    Raises :class:`ConfigError` when the file is readable by group or others, or too short.
    """
    var = "ASYNCCOLL_SECRET_FILE"
    path = environ.get(var)
    if not path:
        var = "the per-user key file"
        base = environ.get("XDG_CONFIG_HOME") or os.path.join(
            environ.get("HOME") or os.path.expanduser("~"), ".config")
        path = os.path.join(base, "asynccoll", "secret")
        if not os.path.exists(path):
            _create_key_file(path)
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(var, f"{path} is accessible by group or others; "
                                   f"run: chmod 600 {path}")
        with open(path, "rb") as f:
            data = f.read(4096).strip()
    except OSError as exc:
        raise ConfigError(var, f"cannot read {path}: {exc}") from exc
    if len(data) < MIN_SECRET:
        raise ConfigError(var, f"{path} holds {len(data)} bytes; at least {MIN_SECRET} needed")
    return data


def _create_key_file(path: str) -> None:
    """Create ``path`` with a fresh random key, atomically: concurrent ranks agree on one."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    key = secrets.token_hex(32).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another rank won the race; then we read its key
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: exclusive create, written at once
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, key)
            finally:
                os.close(fd)
    finally:
        os.unlink(tmp)


def _secret(secret: bytes | str | None, environ: Mapping[str, str]) -> bytes:
    if secret is not None:
        out = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(out) < MIN_SECRET:
            raise ConfigError("secret", f"must be at least {MIN_SECRET} bytes, got {len(out)}")
        return out
    raw = environ.get("ASYNCCOLL_SECRET")
    if raw:
        if len(raw.encode()) < MIN_SECRET:
            raise ConfigError("ASYNCCOLL_SECRET",
                              f"must be at least {MIN_SECRET} characters, got {len(raw)}")
        return raw.encode()
    return user_secret(environ)


def resolve(rank: int | None = None, world_size: int | None = None,
            store: str | tuple[str, int] | None = None, environ: Mapping[str, str] = os.environ,
            *, secret: bytes | str | None = None, transport: str | None = None,
            host: str | None = None, host_store: bool | None = None) -> JobSpec:
    """The :class:`JobSpec` of this process, from arguments and ``environ`` (see module doc).

    ``host_store``: whether this process runs the store; default: rank 0 does, unless
    ``ASYNCCOLL_STORE_HOSTED=1`` says a launcher does. Raises :class:`ConfigError` naming the
    argument or variable at fault. Costs no I/O except reading (or creating) a key file.
    """
    for name, v in (("rank", rank), ("world_size", world_size)):
        if v is not None and (type(v) is not int or v < (0 if name == "rank" else 1)):
            raise ConfigError(name, f"must be an int >= {0 if name == 'rank' else 1}, got {v!r}")
    r, w, source, rvar, wvar = _ranks(rank, world_size, environ)
    cap = _int(environ, "ASYNCCOLL_MAX_WORLD_SIZE", minimum=1) if source == "asynccoll" \
        else None
    if cap is not None and cap < w:
        raise ConfigError("ASYNCCOLL_MAX_WORLD_SIZE", f"must be >= the world size ({wvar}={w}),"
                                                      f" got {cap}")
    if r >= (cap or w):
        raise ConfigError(rvar, f"rank {r} is outside the world of {w} ({wvar}={w})"
                          if cap is None else f"rank {r} is outside the job's {cap} ranks "
                          f"(ASYNCCOLL_MAX_WORLD_SIZE={cap})")
    addr = _store(store, environ)
    if addr is None and (cap or w) > 1:
        var = "SLURM_NTASKS" if source == "slurm" else ("store" if source == "explicit"
                                                        else "ASYNCCOLL_STORE")
        raise ConfigError(var, f"a world of {w} ranks needs a store address: set "
                               "ASYNCCOLL_STORE=host:port (or MASTER_ADDR and MASTER_PORT)")
    scheme = transport or environ.get("ASYNCCOLL_TRANSPORT") or DEFAULT_TRANSPORT
    if scheme not in _TRANSPORTS:
        raise ConfigError("transport" if transport else "ASYNCCOLL_TRANSPORT",
                          f"unknown transport {scheme!r}; known: {list(_TRANSPORTS)}")
    lr_var, local_rank = _first_int(environ, ("ASYNCCOLL_LOCAL_RANK", "LOCAL_RANK",
                                              "SLURM_LOCALID"), source, minimum=0)
    lw_var, local_world = _first_int(environ, ("ASYNCCOLL_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                               "SLURM_NTASKS_PER_NODE"), source, minimum=1)
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise ConfigError(lr_var, f"local rank {local_rank} is outside the {local_world} ranks "
                                  f"of this host ({lw_var}={local_world})")
    if w == 1 and local_rank is None:
        local_rank, local_world = 0, 1
    if host is None:
        host = environ.get("ASYNCCOLL_HOST") or None
        if host is None and environ.get("ASYNCCOLL_IFNAME"):
            host = interface_address(environ["ASYNCCOLL_IFNAME"], "ASYNCCOLL_IFNAME")
    if host_store is None:
        host_store = r == 0 and (cap or w) > 1 and environ.get("ASYNCCOLL_STORE_HOSTED") != "1"
    via = "torchrun" if (store is None and addr is not None and w > 1
                         and torchrun_agent_store(environ)) else None
    restart = _int(environ, "ASYNCCOLL_RESTART", minimum=0) or 0
    if r >= w and addr is None:
        raise ConfigError("ASYNCCOLL_STORE", f"rank {r} joins a running job and needs its "
                                             "store address")
    if restart and host_store:
        raise ConfigError("ASYNCCOLL_RESTART", "a restarted rank cannot host the job's store "
                                               "(the store must outlive every rank: run the "
                                               "job under asynccoll run)")
    return JobSpec(rank=r, world_size=w, store=addr, secret=_secret(secret, environ),
                   transport=scheme, local_rank=local_rank, local_world_size=local_world,
                   host=host, host_store=host_store, source=source, store_via=via,
                   restart=restart, max_world_size=cap if cap != w else None)


_SOURCE_OF = {"ASYNCCOLL_LOCAL_RANK": "asynccoll", "ASYNCCOLL_LOCAL_WORLD_SIZE": "asynccoll",
              "LOCAL_RANK": "torchrun", "LOCAL_WORLD_SIZE": "torchrun",
              "SLURM_LOCALID": "slurm", "SLURM_NTASKS_PER_NODE": "slurm"}


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], source: str, *,
               minimum: int) -> tuple[str, int | None]:
    """(name, value) of the first of ``names`` that is set, preferring ``source``'s variable."""
    ordered = sorted(names, key=lambda n: _SOURCE_OF[n] != source)
    for name in ordered:
        if name == "SLURM_NTASKS_PER_NODE" and "(" in environ.get(name, ""):
            continue  # heterogeneous layout like "2(x3),1": no single local world size
        v = _int(environ, name, minimum=minimum)
        if v is not None:
            return name, v
    return names[0], None


#: whether this process has been told that it runs as a world of one (said once per process)
_said_alone = False


def say_if_alone(spec: JobSpec) -> bool:
    """Log, once per process, that a rank started without any launcher's variables runs as a
    world of one (a script meant for ``asynccoll run -n 4`` would otherwise train alone without a
    word). Returns whether it logged now."""
    global _said_alone
    if spec.source != "default" or _said_alone:
        return False
    _said_alone = True
    import logging

    logging.getLogger("asynccoll").warning(
        "asynccoll: no launcher set ASYNCCOLL_RANK/ASYNCCOLL_WORLD_SIZE, RANK/WORLD_SIZE or "
        "SLURM_PROCID/SLURM_NTASKS: this process runs as a world of one (rank 0 of 1); start "
        "N ranks with `asynccoll run -n N script.py` (or torchrun)")
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on at ``host`` now, below the ephemeral range (read from
    ``/proc/sys/net/ipv4/ip_local_port_range``, else from 32768), so that no socket of this
    job that binds port 0 can take it before its user binds it. Tries random ports; after 64
    busy ones, whatever the system gives for port 0. Costs a bind per try."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    start = max(1024, low - 12000)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = secrets.SystemRandom()
    for _ in range(64 if low - start > 64 else 0):
        port = rng.randrange(start, low)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_address(ifname: str, what: str = "ifname") -> str:
    """The IPv4 address of network interface ``ifname`` (Linux); ConfigError naming ``what``."""
    import fcntl  # POSIX only, so imported where used
    import struct

    if ifname not in {name for _, name in socket.if_nameindex()}:
        raise ConfigError(what, f"no network interface named {ifname!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise ConfigError(what, f"interface {ifname!r} has no IPv4 address") from exc
    return socket.inet_ntoa(packed[20:24])


def listen_host(spec: JobSpec) -> str:
    """The address this rank listens on, reachable by the other ranks.

    ``spec.host`` when set; else ``127.0.0.1`` when the store is on a loopback address (a
    one-host job); else the local address of the route to the store host, found by connecting a
    UDP socket (which sends nothing). Costs one name lookup of the store host.
    """
    if spec.host:
        return spec.host
    if spec.store is None:
        return "127.0.0.1"
    host = spec.store[0]
    try:
        infos = socket.getaddrinfo(host, spec.store[1], socket.AF_INET, socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError("ASYNCCOLL_STORE", f"cannot resolve store host {host!r}: {exc}") \
            from exc
    ip = infos[0][4][0]
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, spec.store[1]))
        except OSError as exc:
            raise ConfigError("ASYNCCOLL_HOST", f"no route to the store host {ip}; set "
                                                "ASYNCCOLL_HOST or ASYNCCOLL_IFNAME") from exc
        local: str = s.getsockname()[0]
    return local
