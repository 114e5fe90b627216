"""A rank of a launcher test. Usage: _worker.py MODE [ARGS]; writes ``PIDDIR/RANK`` first.

hello           print identity lines to stdout and stderr, a last line without newline; exit 0
fail R CODE     rank R exits with CODE once every rank has started (each touches a file in
                TEST_SHARED, if set) and 0.3 s passed; the others sleep up to 60 s
sleep           sleep up to 60 s; print "interrupted" on SIGINT and exit 130
store           node 1's ranks wait 1 s, then every rank bumps a counter in the job's store
stubborn        ignore SIGINT and SIGTERM, sleep up to 60 s (only SIGKILL stops it)
"""

from __future__ import annotations

import os
import signal
import sys
import time

rank = int(os.environ["ASYNCCOLL_RANK"])
mode = sys.argv[1]
piddir = os.environ.get("TEST_PIDDIR")
if piddir:
    with open(os.path.join(piddir, f"{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(piddir, f"{rank}.tmp"), os.path.join(piddir, str(rank)))

if mode == "hello":
    keys = ("ASYNCCOLL_RANK", "ASYNCCOLL_WORLD_SIZE", "ASYNCCOLL_LOCAL_RANK",
            "ASYNCCOLL_NODE_RANK", "ASYNCCOLL_TRANSPORT", "ASYNCCOLL_STORE_HOSTED")
    print("env " + " ".join(f"{k}={os.environ[k]}" for k in keys))
    print(f"store={os.environ['ASYNCCOLL_STORE']} secretlen={len(os.environ['ASYNCCOLL_SECRET'])}")
    print(f"to stderr from {rank}", file=sys.stderr)
    sys.stdout.write(f"no newline from {rank}")
    sys.exit(0)
if mode == "fail":
    shared = os.environ.get("TEST_SHARED")
    if shared:
        open(os.path.join(shared, str(rank)), "w").close()
    if rank == int(sys.argv[2]):
        deadline = time.monotonic() + 30
        world = int(os.environ["ASYNCCOLL_WORLD_SIZE"])
        while shared and len(os.listdir(shared)) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        sys.exit(int(sys.argv[3]))
    time.sleep(60)
    sys.exit(0)
if mode == "sleep":
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    sys.exit(0)
if mode == "store":
    from asynccoll.launch import BlockingStoreClient
    from asynccoll.launch.env import parse_hostport

    time.sleep(1.0 if os.environ["ASYNCCOLL_NODE_RANK"] == "1" else 0.0)
    host, port = parse_hostport(os.environ["ASYNCCOLL_STORE"], "ASYNCCOLL_STORE")
    with BlockingStoreClient(host, port, os.environ["ASYNCCOLL_SECRET"].encode(),
                             timeout=5.0) as store:
        print(f"store ok {store.add('count', 1)}")
    sys.exit(0)
if mode == "stubborn":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring signals", flush=True)
    time.sleep(60)
    sys.exit(0)
raise SystemExit(f"unknown mode {mode}")
