#!/usr/bin/env bash
# Start-up before and after, on the GPU machine: `bench_startup --systems orca-first` on an
# older tree (scratch/base) and on this one, alternately, two rounds, cold page cache,
# bytecode compiled first (as a pip install has it). Prepare the older tree here, then
# carry it with the wheels:
#   rm -rf scratch/base && mkdir -p scratch/base && git archive b47de71 | tar -x -C scratch/base
#   cp load_tests/bench_startup.py scratch/base/load_tests/    # the older tree lacks it
#   rm -rf scratch/base/tests scratch/base/load_tests/results  # (the call's 64 MiB limit)
#   run: bash load_tests/startup_ab.sh      carry: [".whl", "scratch"]
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
SP=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
time (python3 -m compileall -q -j 16 "$SP" /tmp/site /usr/lib/python3.12 $PWD scratch/base > /dev/null 2>&1)
echo "compiled at $(( $(date +%s) - T0 )) s"
python3 -c "import time; t=time.time(); import torch._dynamo, transformers, ray.serve; print('warm import', time.time()-t)"
PYTHONPATH=/tmp/site:$PWD python3 -m load_tests.bench_startup --model llama-8b --systems read --out $OUT/read.json 2>&1 | tail -1
echo "checkpoint at $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for tree in base new; do
    [ $(( $(date +%s) - T0 )) -gt 450 ] && { echo "out of time"; break 2; }
    dir=$PWD; [ $tree = base ] && dir=$PWD/scratch/base
    (cd $dir && PYTHONPATH=/tmp/site:$dir python3 -m load_tests.bench_startup --model llama-8b --dir /tmp/orca-startup-llama-8b --systems orca-first --out $OUT/$tree-$round.json 2>&1 | tail -1 | sed "s/^/$tree $round /")
  done
done
echo "done at $(( $(date +%s) - T0 )) s"
