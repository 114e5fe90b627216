#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU, in one command and well within 10 minutes,
# install what asynccoll's GPU paths need where it is missing and run every CUDA / CuPy test,
# the CUDA-tensor DDP-hook run (tests/torch/test_cuda_hook.py) among them.
#
#   make gpu-check                     (or: bash bench/gpu_check.sh)
#
# What it installs, only where the Python in use lacks it (a machine whose image already holds
# a CUDA build of torch and a CuPy keeps them):
#   - a CUDA build of torch (from $TORCH_INDEX, default the cu128 index of download.pytorch.org)
#   - CuPy (cupy-cuda12x; cupy-cuda13x where torch was built for CUDA 13)
#   - the test tools: pytest, pytest-asyncio, pytest-timeout, hypothesis; asynccoll's own
#     dependencies (numpy, msgpack, rich)
# asynccoll itself runs from this checkout (PYTHONPATH), not installed.
# Offline (no package index reachable): put the wheels in $WHEELS (default .whl), e.g.
#   pip download --no-deps -d .whl pytest-asyncio
# and they are installed from there with --no-index.
#
# `bash bench/gpu_check.sh --list` only lists the tests it would run (no GPU needed).
#
# Environment: PYTHON (default python3), WHEELS, TORCH_INDEX, OUT (a folder for the log,
# default the current one), GPU_CHECK_TIMEOUT (seconds for the tests, default 480).
# Exit status: 0 when every selected test passed and none was skipped for want of CUDA or
# CuPy (the UCX test may skip where ucxx is not installed); 2 when no GPU is usable; else the
# failure's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
LOG="${OUT:-.}/gpu-check.log"
LIMIT=${GPU_CHECK_TIMEOUT:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

say() { printf 'gpu-check: %s\n' "$*" | tee -a "$LOG"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_install() {  # the wheels folder when it has any, else the index
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" "$@"
    else
        "$PY" -m pip install -q --disable-pip-version-check "$@"
    fi || { say "could not install $*: where no package index is reachable, put the wheels" \
                "in $WHEELS (see the head of bench/gpu_check.sh)"; return 1; }
}

mapfile -t files < <(grep -rlE --include='test_*.py' 'cupy|cuda' tests | sort)
if [[ "${1:-}" == --list ]]; then
    exec "$PY" -m pytest -p no:cacheprovider -q --collect-only -k "cupy or cuda" "${files[@]}"
fi

: >"$LOG"
if ! nvidia-smi -L 2>&1 | tee -a "$LOG" | grep -q '^GPU '; then
    say "no NVIDIA GPU here (nvidia-smi -L lists none): nothing to check, nothing installed"
    exit 2
fi

# 1. torch with CUDA
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
    say "installing a CUDA build of torch from $TORCH_INDEX"
    if compgen -G "$WHEELS/torch-*.whl" >/dev/null; then
        pip_install torch || exit 1
    else
        "$PY" -m pip install -q --disable-pip-version-check torch --index-url "$TORCH_INDEX" \
            || exit 1
    fi
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch sees no CUDA device: nothing to check here"
    exit 2
fi

# 2. CuPy, for the CUDA major version torch was built for
if ! "$PY" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" >/dev/null 2>&1; then
    major=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
    say "installing cupy-cuda${major}x"
    pip_install "cupy-cuda${major}x" || exit 1
fi

# 3. the test tools and asynccoll's dependencies
missing=()
for mod_pkg in pytest:pytest pytest_asyncio:pytest-asyncio pytest_timeout:pytest-timeout \
               hypothesis:hypothesis numpy:numpy msgpack:msgpack rich:rich; do
    has "${mod_pkg%%:*}" || missing+=("${mod_pkg##*:}")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    pip_install "${missing[@]}" || exit 1
fi

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, cupy, numpy, torch
import asynccoll
print(f"python {platform.python_version()}, numpy {numpy.__version__}, torch {torch.__version__}"
      f" (CUDA {torch.version.cuda}), cupy {cupy.__version__}, asynccoll {asynccoll.__version__}"
      f" from {asynccoll.__file__}; device: {torch.cuda.get_device_name(0)}")
EOF

# 4. every test that names CUDA or CuPy: the files that mention them, the tests whose names do
say "tests: ${files[*]} -k 'cupy or cuda'"
timeout -k 10 "$LIMIT" "$PY" -m pytest -p no:cacheprovider -q -rs --timeout 240 \
    -k "cupy or cuda" "${files[@]}" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
if ((status == 124)); then
    say "the tests ran past ${LIMIT} s"
elif ((status == 0)) && grep -E '^SKIPPED' "$LOG" | grep -viq 'ucxx'; then
    say "a GPU test was skipped (above): this machine did not check it"
    status=3
fi
say "exit status $status; log: $LOG"
exit "$status"
