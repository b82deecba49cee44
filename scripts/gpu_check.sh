#!/usr/bin/env bash
# GPU check of onebit on one CUDA machine, offline, in under 8 minutes:
#   1. a Python with a CUDA build of torch (the system's if it has one) and the test tools;
#      nothing is downloaded: a missing package is installed from local wheels only;
#   2. the tests marked `cuda` (pytest -m cuda);
#   3. the other tests of the triton backend, on the GPU: its exchange kernels and its
#      update kernels against the torch reference on CUDA in float32;
#   4. timings of compressed_allreduce (world size 1) at 2^24 and 2^26 float32 elements,
#      torch and triton backends, in device-to-device copies of the same buffer;
#   5. every optimizer's kinds of step on BERT-base and BERT-Large shapes beside
#      torch.optim.AdamW(fused=True) and AdamW(foreach=True), in ms and copies, with the
#      targets (benchmarks/optimizer_steps.py; its JSON is step-benchmark.json in LOG_DIR);
#   6. the optimizers on the GPU against the same run on CPU, and on 2 NCCL ranks against 2
#      gloo ranks where two GPUs are visible (benchmarks/gpu_optimizer_check.py).
# Every step runs under its own timeout; a failure is recorded, never fatal. One summary is
# printed at the end; each step's full output is in LOG_DIR.
#
# Usage: scripts/gpu_check.sh [LOG_DIR]
# Environment: ONEBIT_PYTHON (a Python to try first), GPU_CHECK_BUDGET_S (default 470),
# GPU_CHECK_WHEELS (a folder of wheels for missing packages, default .whl).

set -u
set -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_DIR=${1:-$(mktemp -d -t onebit-gpu-check.XXXXXX)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
SITE=$LOG_DIR/site # where missing packages go (pip install --target)
mkdir -p "$LOG_DIR"
cd "$REPO" || exit 1

# The project runs from its source tree: nothing to install. Kernels compile for the GPU
# (not Triton's interpreter), and every backend is picked explicitly or by "auto".
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}:$SITE"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET ONEBIT_KERNELS

NAMES=() STATUSES=() DETAILS=()
PY=""
SKIPPED=77 # a step's exit status for "did not apply"

record() { # record NAME STATUS DETAIL
    NAMES+=("$1")
    STATUSES+=("$2")
    DETAILS+=("$3")
    printf '== %-18s %-7s %s\n' "$1" "$2" "$3"
}

pytest_line() { # the last pytest summary line of a log
    grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran' "$1" |
        tail -n 1 | sed -E 's/=+//g; s/^ +| +$//g'
}

run_step() { # run_step NAME TIMEOUT_S COMMAND...: COMMAND under a timeout, output to NAME.log
    local name=$1 limit=$2 left rc detail
    shift 2
    left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
        record "$name" SKIP "the time budget (${BUDGET_S}s) is spent"
        return
    fi
    ((limit > left)) && limit=$left
    echo "-- $name (at most ${limit}s)"
    local start=$SECONDS log="$LOG_DIR/$name.log"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    detail=$(pytest_line "$log")
    [[ -z $detail ]] && detail=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)
    detail="${detail:+$detail }($((SECONDS - start))s)"
    case $rc in
    0) record "$name" PASS "$detail" ;;
    "$SKIPPED") record "$name" SKIP "$detail" ;;
    124 | 137) record "$name" TIMEOUT "killed after ${limit}s: $detail" ;;
    *) record "$name" FAIL "exit $rc: $detail" ;;
    esac
}

has_cuda_torch() { # has_cuda_torch PYTHON
    timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}

pip_install() { # pip_install PACKAGE...: from the wheels in WHEELS into SITE, no network
    timeout 300 "$PY" -m pip install --no-index --find-links "$WHEELS" --target "$SITE" "$@"
}

# -- 1. environment ----------------------------------------------------------------------
find_python() {
    local candidate
    for candidate in "${ONEBIT_PYTHON:-}" python3 python3.12 python "$REPO/.venv/bin/python"; do
        [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        if has_cuda_torch "$candidate"; then
            PY=$(command -v "$candidate")
            return 0
        fi
    done
    return 1
}

setup_environment() {
    local log="$LOG_DIR/environment.log" missing=()
    if ! find_python; then
        echo "no Python with a CUDA build of torch; installing torch from $WHEELS" >>"$log"
        PY=$(command -v python3 || true)
        if [[ -z $PY ]] || ! pip_install torch >>"$log" 2>&1 || ! has_cuda_torch "$PY"; then
            PY=""
            record environment FAIL "no Python with a CUDA build of torch, and none in $WHEELS: \
install one, or set ONEBIT_PYTHON to a Python that has it"
            return 1
        fi
    fi
    for module in numpy pytest; do
        timeout 60 "$PY" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
    done
    if ((${#missing[@]})) && ! pip_install "${missing[@]}" >>"$log" 2>&1; then
        record environment FAIL "$PY lacks ${missing[*]}, and $WHEELS does not hold them"
        return 1
    fi
    local versions
    versions=$(timeout 120 "$PY" - 2>>"$log" <<'EOF'
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
import onebit.kernels as kernels
print(f"torch {torch.__version__}, triton {triton_version}, {torch.cuda.get_device_name()}, "
      f"backends {kernels.available()}")
EOF
    ) || {
        record environment FAIL "$PY cannot report torch, triton and onebit (see environment.log)"
        return 1
    }
    record environment PASS "$PY: $versions"
}

# -- 2. the tests marked cuda --------------------------------------------------------------
cuda_tests() {
    # Modules that cannot be imported here (an optional package missing) are reported, not
    # counted as failures: only a failed or erroring test is.
    local report="$LOG_DIR/cuda-tests.report" rc
    "$PY" -m pytest -m cuda -q -rfE -p no:cacheprovider --continue-on-collection-errors 2>&1 |
        tee "$report"
    rc=${PIPESTATUS[0]}
    if ((rc == 1)) && ! grep -qE '^(FAILED|ERROR) [^ ]+::' "$report" &&
        grep -qE '[0-9]+ passed' "$report"; then
        echo "(no cuda test failed; the modules above that could not be imported were skipped)"
        return 0
    fi
    return "$rc"
}

# -- 4. timings --------------------------------------------------------------------------
time_allreduce() {
    "$PY" - <<'EOF'
"""compressed_allreduce (world size 1) and its five local stages, per backend, in copies."""
import torch

import onebit
from onebit import kernels

device = torch.device("cuda")


def milliseconds(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


for log2 in (24, 26):
    numel = 1 << log2
    buffer = torch.randn(numel, device=device)
    out = torch.empty_like(buffer)
    copy = milliseconds(lambda: out.copy_(buffer), 50)
    print(f"2^{log2} float32: one copy {1e3 * copy:.0f} us")
    for name in ("torch", "triton"):
        backend = kernels.select(buffer, name).compression
        worker_error, server_error = torch.zeros_like(buffer), torch.zeros_like(buffer)
        workspace = onebit.CompressionWorkspace()

        def allreduce():
            onebit.compressed_allreduce(
                buffer, worker_error, server_error, out=out, workspace=workspace,
                kernels=name,
            )

        scratch = backend.scratch(numel, 1, buffer.dtype, device)
        packed = torch.empty(numel // 8, dtype=torch.uint8, device=device)
        server_packed = torch.empty_like(packed)

        def stages():
            a = backend.worker_compress(buffer, worker_error, packed, out, scratch)
            backend.worker_error_update(buffer, worker_error, packed, a, out, scratch)
            received, scales = packed.view(1, -1), a.reshape(1)
            b = backend.server_compress(received, scales, server_error, server_packed, scratch)
            backend.server_error_update(
                received, scales, server_error, server_packed, b, scratch
            )
            backend.decode(server_packed.view(1, -1), b.reshape(1), out)

        call, local = milliseconds(allreduce, 20), milliseconds(stages, 20)
        print(
            f"  {name:6s}: compressed_allreduce {call / copy:5.1f} copies ({1e3 * call:.0f} us),"
            f" five stages alone {local / copy:5.1f} copies ({1e3 * local:.0f} us)"
        )
EOF
}

# -- 5. optimizer steps ------------------------------------------------------------------
step_benchmark() {
    "$PY" benchmarks/optimizer_steps.py --repeats 15 --out "$LOG_DIR/step-benchmark.json"
}

# -- 6. the optimizers on CUDA --------------------------------------------------------
# The optimizers on CUDA against CPU (and 2 NCCL ranks against 2 gloo ranks where two GPUs
# are visible); exit 77 when nothing could run.
nccl_optimizer_check() {
    "$PY" benchmarks/gpu_optimizer_check.py
}

# -- run ---------------------------------------------------------------------------------
if setup_environment; then
    export PY SKIPPED LOG_DIR
    export -f cuda_tests time_allreduce step_benchmark nccl_optimizer_check
    run_step cuda-tests 120 bash -c cuda_tests
    run_step triton-kernel-tests 100 "$PY" -m pytest -q -p no:cacheprovider \
        tests/unit/test_kernels.py tests/unit/test_backends_float32.py -k triton -m "not cuda"
    run_step timings 60 bash -c time_allreduce
    run_step step-benchmark 150 bash -c step_benchmark
    run_step nccl-optimizer 60 bash -c nccl_optimizer_check
fi

echo
echo "================ onebit GPU check: summary ($SECONDS s; logs in $LOG_DIR) ================"
failed=0
for i in "${!NAMES[@]}"; do
    printf '%-20s %-7s %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${DETAILS[$i]}"
    [[ ${STATUSES[$i]} == PASS || ${STATUSES[$i]} == SKIP ]] || failed=1
done
for i in "${!NAMES[@]}"; do
    log="$LOG_DIR/${NAMES[$i]}.log"
    if [[ ${NAMES[$i]} == timings || ${NAMES[$i]} == step-benchmark ]] &&
        [[ ${STATUSES[$i]} == PASS ]]; then
        echo "-- ${NAMES[$i]}"
        cat "$log"
    elif [[ ${STATUSES[$i]} == FAIL || ${STATUSES[$i]} == TIMEOUT ]] && [[ -s $log ]]; then
        echo "-- the end of ${NAMES[$i]}.log"
        tail -n 20 "$log"
    fi
done
exit "$failed"
