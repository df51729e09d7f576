#!/usr/bin/env bash
# The GPU checks and the GPU benchmark, on a machine with a CUDA device (torch built
# with CUDA, cupy, numba and greenlet installed; no DyNet: the dynet38 wheel is CPU only).
#
#   bash bench/gpu.sh OUTDIR [BENCH_SECONDS] [BENCH ARGS...]
#
# Writes OUTDIR/env.txt (devices, versions), OUTDIR/tests.txt (tests/test_gpu.py and the
# CUDA kernel tests of tests/test_kernels.py, run on the device) and OUTDIR/gpu.{md,json}
# (python -m bench.run --device cuda; its results are rewritten after each case, so a
# run cut off at BENCH_SECONDS keeps the cases it finished; 0: no benchmark). Cases left
# for another call (e.g. --sizes large there) join this run's with
# python -m bench.run --merge OUTDIR/gpu.json OTHER.json --out MERGED.
set -u
out=${1:?usage: bash bench/gpu.sh OUTDIR [BENCH_SECONDS] [BENCH ARGS...]}
seconds=${2:-300}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    $py -c 'import sys, torch, numba, greenlet; print(sys.version.split()[0], torch.__version__,
torch.version.cuda, numba.__version__, greenlet.__version__, torch.cuda.get_device_name())'
    $py -c 'import cupy; print("cupy", cupy.__version__)' 2>&1 | tail -1
    # the C helpers of the record path (without them acrobat runs the same steps in Python)
    $py setup.py -q build_ext --inplace 2>&1 | tail -3
    $py -c 'import acrobat.tensor as t; print("record path:", "C" if t._native else "Python")'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
tests() {
    timeout "${TEST_SECONDS:-200}" $py -m pytest -q -p no:cacheprovider tests/test_gpu.py \
        tests/test_kernels.py -k "gpu or cuda" -rs --maxfail=20 --tb=short >"$out/$1" 2>&1
    rc=$?
    echo "tests: exit $rc"
    tail -40 "$out/$1"
}
tests tests.txt
if [ "$rc" -ge 128 ]; then  # a crash: the same without the C helpers
    export ACROBAT_NATIVE=0
    echo "crashed: again with ACROBAT_NATIVE=0"
    tests tests_python.txt
fi
[ "$seconds" = 0 ] && exit 0  # (the checks only)
timeout "$seconds" $py -m bench.run --device cuda --no-dynet --out "$out/gpu" "$@" >"$out/bench.log" 2>&1
echo "bench: exit $?"
grep -v "bench:" "$out/bench.log" | tail -60
