"""Environment resolution: each source, the precedence, the secret, and errors naming variables."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from asynccoll.launch.env import (
    ConfigError,
    JobSpec,
    free_port,
    listen_host,
    parse_hostport,
    resolve,
)

SECRET = "0123456789abcdef0123"


def env(**kw: str) -> dict[str, str]:
    return {"ASYNCCOLL_SECRET": SECRET, **kw}


def test_explicit_arguments() -> None:
    spec = resolve(2, 4, "10.0.0.1:1234", environ=env())
    assert (spec.rank, spec.world_size, spec.store, spec.source) == (2, 4, ("10.0.0.1", 1234),
                                                                      "explicit")
    assert spec.secret == SECRET.encode()
    assert spec.transport == "tcp"
    assert not spec.host_store
    assert resolve(0, 4, ("h", 9), environ=env()).host_store  # rank 0 hosts by default


def test_asynccoll_variables() -> None:
    spec = resolve(environ=env(ASYNCCOLL_RANK="1", ASYNCCOLL_WORLD_SIZE="3",
                               ASYNCCOLL_STORE="127.0.0.1:5000", ASYNCCOLL_TRANSPORT="ucx",
                               ASYNCCOLL_LOCAL_RANK="1", ASYNCCOLL_LOCAL_WORLD_SIZE="3",
                               ASYNCCOLL_HOST="127.0.0.2"))
    assert (spec.rank, spec.world_size, spec.store) == (1, 3, ("127.0.0.1", 5000))
    assert (spec.transport, spec.local_rank, spec.local_world_size) == ("ucx", 1, 3)
    assert spec.host == "127.0.0.2"
    assert spec.source == "asynccoll"
    launched = resolve(environ=env(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="3",
                                   ASYNCCOLL_STORE="h:1", ASYNCCOLL_STORE_HOSTED="1"))
    assert not launched.host_store  # the launcher runs the store


def test_a_job_that_may_grow_has_vacant_ranks_above_its_first_world() -> None:
    base = {"ASYNCCOLL_WORLD_SIZE": "2", "ASYNCCOLL_MAX_WORLD_SIZE": "4",
            "ASYNCCOLL_STORE": "h:1", "ASYNCCOLL_STORE_HOSTED": "1"}
    first = resolve(environ=env(ASYNCCOLL_RANK="1", **base))
    assert (first.world_size, first.capacity, first.grows) == (2, 4, False)
    new = resolve(environ=env(ASYNCCOLL_RANK="3", **base))
    assert (new.rank, new.world_size, new.capacity, new.grows) == (3, 2, 4, True)
    same = resolve(environ=env(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="2",
                               ASYNCCOLL_MAX_WORLD_SIZE="2", ASYNCCOLL_STORE="h:1"))
    assert (same.max_world_size, same.capacity) == (None, 2)
    with pytest.raises(ConfigError, match="outside the job's 4 ranks"):
        resolve(environ=env(ASYNCCOLL_RANK="4", **base))
    with pytest.raises(ConfigError, match=r"ASYNCCOLL_MAX_WORLD_SIZE.*must be >= the world"):
        resolve(environ=env(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="3",
                            ASYNCCOLL_MAX_WORLD_SIZE="2", ASYNCCOLL_STORE="h:1"))
    with pytest.raises(ConfigError, match=r"ASYNCCOLL_MAX_WORLD_SIZE.*integer"):
        resolve(environ=env(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="1",
                            ASYNCCOLL_MAX_WORLD_SIZE="two"))
    with pytest.raises(ConfigError, match="needs a store address"):
        resolve(environ=env(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="1",
                            ASYNCCOLL_MAX_WORLD_SIZE="2"))


def test_torchrun_variables_use_master_port_plus_one() -> None:
    spec = resolve(environ=env(RANK="3", WORLD_SIZE="8", MASTER_ADDR="node0",
                               MASTER_PORT="29500", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4"))
    assert (spec.rank, spec.world_size, spec.store) == (3, 8, ("node0", 29501))
    assert (spec.local_rank, spec.local_world_size, spec.source) == (1, 4, "torchrun")
    assert resolve(environ=env(RANK="0", WORLD_SIZE="8", MASTER_ADDR="n",
                               MASTER_PORT="29500")).host_store


def test_torchrun_agent_store_is_used_instead_of_a_guessed_port() -> None:
    """torchrun shares its store (TORCHELASTIC_USE_AGENT_STORE=True): asynccoll's store port
    is published there, so spec.store is torchrun's own address and no port is guessed."""
    tr = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "29500",
          "TORCHELASTIC_USE_AGENT_STORE": "True"}
    spec = resolve(environ=env(**tr))
    assert (spec.store, spec.store_via) == (("n0", 29500), "torchrun")
    assert resolve(environ=env(**{**tr, "RANK": "0"})).host_store
    assert resolve(environ=env(**tr, ASYNCCOLL_STORE="h:7")).store_via is None
    plain = resolve(environ=env(**{**tr, "TORCHELASTIC_USE_AGENT_STORE": "False"}))
    assert (plain.store, plain.store_via) == (("n0", 29501), None)


def test_free_port_is_below_the_ephemeral_range() -> None:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0]) \
        if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range") else 32768
    ports = {free_port() for _ in range(5)}
    assert all(1024 <= p < low for p in ports), (ports, low)


def test_slurm_variables_need_a_store_address() -> None:
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2",
             "SLURM_NTASKS_PER_NODE": "3"}
    with pytest.raises(ConfigError, match="store address") as info:
        resolve(environ=env(**slurm))
    assert info.value.variable == "SLURM_NTASKS"
    spec = resolve(environ=env(**slurm, ASYNCCOLL_STORE="head:7000"))
    assert (spec.rank, spec.world_size, spec.store, spec.source) == (5, 6, ("head", 7000),
                                                                      "slurm")
    assert (spec.local_rank, spec.local_world_size) == (2, 3)
    spec = resolve(environ=env(**slurm, MASTER_ADDR="head", MASTER_PORT="7000"))
    assert spec.store == ("head", 7001)


def test_precedence_explicit_then_asynccoll_then_torchrun_then_slurm() -> None:
    everything = env(ASYNCCOLL_RANK="1", ASYNCCOLL_WORLD_SIZE="2", ASYNCCOLL_STORE="a:1",
                     RANK="2", WORLD_SIZE="3", MASTER_ADDR="m", MASTER_PORT="10",
                     SLURM_PROCID="3", SLURM_NTASKS="4")
    assert (resolve(0, 5, "x:9", environ=everything).rank, 5) == (0, 5)
    s = resolve(environ=everything)
    assert (s.rank, s.world_size, s.store, s.source) == (1, 2, ("a", 1), "asynccoll")
    no_acoll = {k: v for k, v in everything.items() if not k.startswith("ASYNCCOLL_RANK")
                and k not in ("ASYNCCOLL_WORLD_SIZE", "ASYNCCOLL_STORE")}
    s = resolve(environ=no_acoll)
    assert (s.rank, s.world_size, s.store, s.source) == (2, 3, ("m", 11), "torchrun")
    slurm_only = {k: v for k, v in no_acoll.items() if k not in ("RANK", "WORLD_SIZE")}
    s = resolve(environ=slurm_only)
    assert (s.rank, s.world_size, s.store, s.source) == (3, 4, ("m", 11), "slurm")
    # the store falls through independently: explicit rank with ASYNCCOLL_STORE
    assert resolve(0, 2, environ=everything).store == ("a", 1)


def test_a_lone_process_needs_nothing(tmp_path: Path) -> None:
    spec = resolve(environ={"HOME": str(tmp_path)})
    assert (spec.rank, spec.world_size, spec.store, spec.source) == (0, 1, None, "default")
    assert spec.local_rank == 0
    assert not spec.host_store


@pytest.mark.parametrize(("environ", "variable", "match"), [
    ({"ASYNCCOLL_RANK": "3", "ASYNCCOLL_WORLD_SIZE": "2", "ASYNCCOLL_STORE": "h:1"},
     "ASYNCCOLL_RANK", "outside the world of 2"),
    ({"ASYNCCOLL_RANK": "0"}, "ASYNCCOLL_WORLD_SIZE", "not set"),
    ({"ASYNCCOLL_WORLD_SIZE": "2"}, "ASYNCCOLL_RANK", "not set"),
    ({"RANK": "1"}, "WORLD_SIZE", "not set but RANK=1"),
    ({"WORLD_SIZE": "4"}, "RANK", "not set"),
    ({"SLURM_PROCID": "1"}, "SLURM_NTASKS", "not set"),
    ({"ASYNCCOLL_RANK": "x", "ASYNCCOLL_WORLD_SIZE": "2"}, "ASYNCCOLL_RANK", "integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE", ">= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK", ">= 0"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "ASYNCCOLL_STORE", "store address"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT", "not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "5"}, "MASTER_ADDR", "not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "p"},
     "MASTER_PORT", "integer"),
    ({"ASYNCCOLL_STORE": "nohostport"}, "ASYNCCOLL_STORE", "host:port"),
    ({"ASYNCCOLL_STORE": "h:99999"}, "ASYNCCOLL_STORE", "65535"),
    ({"ASYNCCOLL_TRANSPORT": "carrier-pigeon"}, "ASYNCCOLL_TRANSPORT", "unknown transport"),
    ({"ASYNCCOLL_SECRET": "short"}, "ASYNCCOLL_SECRET", "at least 16"),
    ({"ASYNCCOLL_LOCAL_RANK": "z"}, "ASYNCCOLL_LOCAL_RANK", "integer"),
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "5", "LOCAL_RANK": "2",
      "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK", "outside the 2 ranks of this host"),
    ({"ASYNCCOLL_IFNAME": "no-such-if0"}, "ASYNCCOLL_IFNAME", "no network interface"),
])
def test_errors_name_their_variable(environ: dict[str, str], variable: str, match: str) -> None:
    base = {"ASYNCCOLL_SECRET": SECRET}
    with pytest.raises(ConfigError, match=match) as info:
        resolve(environ={**base, **environ})
    assert info.value.variable == variable
    assert variable in str(info.value)


def test_explicit_argument_errors_name_the_argument() -> None:
    with pytest.raises(ConfigError, match="world_size") as info:
        resolve(rank=1, environ=env())
    assert info.value.variable == "world_size"
    with pytest.raises(ConfigError) as info:
        resolve(rank=-1, world_size=2, store="h:1", environ=env())
    assert info.value.variable == "rank"
    with pytest.raises(ConfigError) as info:
        resolve(rank=2, world_size=2, store="h:1", environ=env())
    assert info.value.variable == "rank"
    with pytest.raises(ConfigError) as info:
        resolve(0, 2, "h:1", environ=env(), secret=b"tiny")
    assert info.value.variable == "secret"
    with pytest.raises(ConfigError) as info:
        resolve(0, 2, "h:1", environ=env(), transport="smoke")
    assert info.value.variable == "transport"
    assert isinstance(info.value, ValueError)


def test_per_user_key_file_is_created_private_and_shared(tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path)}
    a = resolve(0, 2, "h:1", environ=environ)
    b = resolve(1, 2, "h:1", environ=environ)
    path = tmp_path / ".config" / "asynccoll" / "secret"
    assert a.secret == b.secret == path.read_bytes()
    assert len(a.secret) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]  # no temporary files left behind
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve(0, 2, "h:1", environ=environ)


def test_secret_precedence(tmp_path: Path) -> None:
    f = tmp_path / "job.key"
    f.write_bytes(b"from-the-file-0123456789\n")
    f.chmod(0o600)
    environ = {"HOME": str(tmp_path), "ASYNCCOLL_SECRET_FILE": str(f)}
    assert resolve(environ=environ).secret == b"from-the-file-0123456789"
    environ["ASYNCCOLL_SECRET"] = SECRET
    assert resolve(environ=environ).secret == SECRET.encode()
    assert resolve(environ=environ, secret=b"x" * 16).secret == b"x" * 16
    missing = {"ASYNCCOLL_SECRET_FILE": str(tmp_path / "absent")}
    with pytest.raises(ConfigError, match="cannot read") as info:
        resolve(environ=missing)
    assert info.value.variable == "ASYNCCOLL_SECRET_FILE"


def test_secret_is_not_in_the_repr() -> None:
    assert SECRET not in repr(resolve(0, 1, environ=env()))


def test_listen_host() -> None:
    spec = resolve(1, 2, "127.0.0.1:5", environ=env())
    assert listen_host(spec) == "127.0.0.1"
    assert listen_host(resolve(1, 2, "localhost:5", environ=env())) == "127.0.0.1"
    assert listen_host(resolve(1, 2, "127.0.0.1:5", environ=env(ASYNCCOLL_HOST="10.1.2.3"))) \
        == "10.1.2.3"
    assert listen_host(resolve(0, 1, environ=env())) == "127.0.0.1"
    lo = resolve(0, 1, environ=env(ASYNCCOLL_IFNAME="lo"))
    assert lo.host == "127.0.0.1"


def test_parse_hostport() -> None:
    assert parse_hostport("[::1]:80", "x") == ("::1", 80)
    with pytest.raises(ConfigError, match="--rdzv"):
        parse_hostport(":80", "--rdzv")


def test_jobspec_is_frozen() -> None:
    spec = resolve(0, 1, environ=env())
    assert isinstance(spec, JobSpec)
    with pytest.raises(AttributeError):
        spec.rank = 3  # type: ignore[misc]
