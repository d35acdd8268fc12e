#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and a CUDA build of torch (nvcc of the
# same CUDA major version, NCCL as torch loads it), one command builds pyddp in
# place for the GPUs present, runs the GPU tests and a GPU benchmark sweep, and
# prints a summary last:
#
#     bash tests/gpu/check.sh            # logs in $OUT when set, else a temp dir
#
# Where the ranks share one GPU, start NVIDIA's MPS daemon first
# (`nvidia-cuda-mps-control -d`; `echo quit | nvidia-cuda-mps-control` stops
# it): without it the two processes take turns on the GPU, and the cuda_ipc
# transport's waits between them crawl (docs/architecture.md, "What the GPU
# runs so far showed"). The runs recorded there had it running.
#
# Steps, each bounded (the whole check fits in 6 minutes on one H100/H200 with
# 16 cores, the build about 55 s of it, the tests 115 s, the bench 85 s):
#   build  setup.py build_ext --inplace, CUDA forced (an impossible CUDA build
#          fails here rather than testing a CPU-only one);
#   tests  pytest -m cuda over tests/ (one line per test, so a step stopped at
#          its bound still shows what passed), 2 ranks sharing the GPU where
#          there is one, each test bounded by pytest-timeout when installed;
#   bench  every CUDA transport of pyddp beside torch's NCCL, 4 KiB to 256 MiB,
#          results checked on every rank (the bench exits 1 on a wrong element).
# A step that fails or runs over its bound is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pyddp-gpu-check.XXXXXX")}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()

# step NAME SECONDS COMMAND...: runs COMMAND with its output in $out/NAME.log.
step() {
    local name="$1" limit="$2" start=$SECONDS rc
    shift 2
    echo "== gpu check: $name (at most $limit s): $*"
    timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 25 "$out/$name.log"
    case $rc in
        0) verdict="ok" ;;
        124|137) verdict="TIMED OUT after $limit s" ;;
        *) verdict="FAILED (exit $rc)" ;;
    esac
    summary+=("$name: $verdict in $((SECONDS - start)) s; log $out/$name.log")
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvidia-smi -q | grep -i "MPS\|compute mode" || true
    python -c 'import sys, torch; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "nccl",
torch.cuda.nccl.version() if torch.version.cuda else None, "gpus", torch.cuda.device_count())'
    "${CXX:-c++}" --version | head -n 1
} > "$out/machine.log" 2>&1
cat "$out/machine.log"

timeout_flag=()
if python -c 'import pytest_timeout' 2>/dev/null; then timeout_flag=(--timeout 90); fi

if step build 240 env PYDDP_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
        python setup.py build_ext --inplace; then
    step tests 180 python -m pytest -m cuda tests -v -rs -p no:cacheprovider \
        "${timeout_flag[@]}" --junitxml "$out/tests.xml"
    step bench 150 python -m pyddp.bench \
        --peers nccl,pyddp_ipc_ring,pyddp_ipc_direct,pyddp_nccl,pyddp_nccl_ring \
        --ops all_reduce,all_gather,broadcast,reduce_scatter -b 4K -e 256M -f 4 \
        --trials 3 --target-time 0.1 -w 2 --check --timeout 60 --json "$out/bench.json"
fi

echo "== gpu check: summary (logs in $out)"
cat "$out/machine.log"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -qv ": ok in " "$out/summary.txt"
