#!/usr/bin/env bash
# Online latency-throughput sweep, systems side by side (ORCA Figure 10's form), one at a
# time on the same device: this engine through `serve run`, then transformers' continuous
# batching (its defaults, and tuned as in NOTES.md) and static batching behind
# load_tests/hf_server.py, all driven by the same load client with the same trace, then the
# report (table, plot, sustained rates) of every load-*.json in $OUT, so systems swept in
# separate calls report together. HF_CB_CONFIG replaces hf-cb-tuned's config (JSON).
#   MODEL=llama-8b DEVICE=cuda bash load_tests/load_sweep.sh        (the GPU machine)
#   MODEL=tiny-random-llama DEVICE=cpu RATES=2,8 DURATION=5 bash load_tests/load_sweep.sh
set -uo pipefail
MODEL=${MODEL:-llama-8b}; DEVICE=${DEVICE:-cuda}; OUT=${OUT:-out}
# default rates: llama-8b on one H200, up to and past each system's knee (ORCA's offline trace
# runs at ~97 req/s in the engine, ~16 in hf-cb-tuned, ~13 in hf-cb, ~9 in hf-static);
# HF_RATES sets every baseline's, RATES_HF_CB, RATES_HF_CB_TUNED, RATES_HF_STATIC one's
TRACE=${TRACE:-orca}; RATES=${RATES:-8,32,56,72,88,104}
RATES_HF_STATIC=${RATES_HF_STATIC:-${HF_RATES:-1,2,4,6,8}}
RATES_HF_CB=${RATES_HF_CB:-${HF_RATES:-2,4,8,12,16}}
RATES_HF_CB_TUNED=${RATES_HF_CB_TUNED:-${HF_RATES:-2,4,8,12,16,20}}
DURATION=${DURATION:-60}; SYSTEMS=${SYSTEMS:-"orca hf-cb hf-cb-tuned hf-static"}
# the engine's token budget per iteration: it bounds how long one iteration (and so the gap
# between two tokens of a running request) can take when many prompts arrive at once. On
# llama-8b/H200, ORCA's trace, 512 served as many requests/s as 2048 (~100), with two thirds
# of its TPOT at 88 req/s and ITL p99 within 3x TPOT p50 at every rate (BENCHMARKS.md)
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-512}
PY=${PY:-python3}
# load client processes: one Python process parsing every streamed event falls behind at
# ~100 req/s of ORCA's trace on llama-8b (see load_tests/sender.py: send_in_processes). Several
# values ("4 1") run the engine's rates once per value on one server, as orca-p4, orca-p1.
CLIENT_PROCESSES=${CLIENT_PROCESSES:-4}
[[ $CLIENT_PROCESSES =~ ^[1-9][0-9]*( [1-9][0-9]*)*$ ]] || {
  echo "CLIENT_PROCESSES must be counts separated by spaces, e.g. \"4 1\"" >&2; exit 2; }
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
VOCAB=$($PY -c "from engine_actors.checkpoint import load_hf_config, resolve_model_path; print(load_hf_config(resolve_model_path('$MODEL')).vocab_size)")
wait_up() {  # until GET url/health answers 200 (5 minutes at most)
  $PY -c "import httpx, sys, time
for _ in range(300):
    try:
        if httpx.get(sys.argv[1] + '/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: pass
    time.sleep(1)
sys.exit(1)" "$1"
}
client() {  # system url rates [client processes] [seed]
  $PY -m load_tests.load_client --url "$2" --system "$1" --trace "$TRACE" --vocab-size "$VOCAB" \
    --rates "$3" --duration "$DURATION" --drain-timeout 120 --no-progress --seed "${5:-0}" \
    --processes "${4:-${CLIENT_PROCESSES%% *}}" --out "$OUT/load-$1.json" 2>&1 | tail -12
}
for system in $SYSTEMS; do
  echo "=== $system"
  case $system in
    orca)
      $PY - "$MODEL" "$DEVICE" "$MAX_NUM_BATCHED_TOKENS" > /tmp/sweep_config.yaml <<'PYEOF'
import sys, yaml
cfg = yaml.safe_load(open("serve_config.yaml"))
args = cfg["applications"][0]["args"]
args.update(model=sys.argv[1], device=sys.argv[2], max_batch_size=256,
            max_num_batched_tokens=int(sys.argv[3]))
args.pop("max_num_tokens", None) if sys.argv[2] == "cuda" else None
print(yaml.safe_dump(cfg))
PYEOF
      $PY -m deployments.launch /tmp/sweep_config.yaml > "$OUT/serve-orca.log" 2>&1 &
      pid=$!
      if ! wait_up http://127.0.0.1:8000; then echo "orca did not come up"; tail -20 "$OUT/serve-orca.log"
      elif [ "$CLIENT_PROCESSES" = "${CLIENT_PROCESSES%% *}" ]; then client orca http://127.0.0.1:8000 "$RATES"
      else  # one server: each pass its own prompts (a seed each), none from the prefix cache
        seed=0; for n in $CLIENT_PROCESSES; do
          client "orca-p$n" http://127.0.0.1:8000 "$RATES" "$n" $((seed++)); done
      fi
      kill -TERM $pid; wait $pid ;;
    hf-cb|hf-cb-tuned|hf-static)
      extra=()
      case $system in
        hf-static) mode=static; extra=(--max-batch-size 32) ;;
        hf-cb) mode=cb  # transformers' defaults (on CPU: a KV pool that fits the machine)
          [ "$DEVICE" = cpu ] && extra=(--cb-config '{"num_blocks": 256, "max_batch_tokens": 256}') ;;
        hf-cb-tuned) mode=cb  # NOTES.md: CUDA graphs, 16384-token batches, compiled
          extra=(--cb-config "${HF_CB_CONFIG:-{\"use_cuda_graph\": true, \"max_batch_tokens\": 16384, \"default_compile_level\": 1\}}")
          [ "$DEVICE" = cpu ] && extra=(--cb-config '{"num_blocks": 256, "max_batch_tokens": 256}') ;;
      esac
      $PY -m load_tests.hf_server --model "$MODEL" --device "$DEVICE" --mode "$mode" \
        --port 8100 "${extra[@]}" > "$OUT/serve-$system.log" 2>&1 &
      pid=$!
      var=RATES_$(echo "$system" | tr 'a-z-' 'A-Z_')  # RATES_HF_CB_TUNED, ...
      if wait_up http://127.0.0.1:8100; then client "$system" http://127.0.0.1:8100 "${!var}"
      else echo "$system did not come up"; tail -20 "$OUT/serve-$system.log"; fi
      kill $pid; wait $pid ;;
  esac
done
$PY -m load_tests.report "$OUT"/load-*.json --plot "$OUT/latency-throughput.png" \
  --markdown "$OUT/load.md"
