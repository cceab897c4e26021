#!/usr/bin/env bash
# An interactive class behind a full batch of long decodes (fault round 4): `kvfabric up
# --engine mock` with one engine of 4 batch slots, batch requests decoding 600 tokens each
# (4.8 s at the mock's 8 ms a step) offered faster than the slots free (1/s against 0.83/s),
# and interactive requests (40-token prompts, 1 token out, TTFT target 300 ms) at 1/s.
#   alone   the interactive requests alone, at the same rate
#   edf     beside the batch load, earliest deadline first: an interactive request that would
#           miss its target waiting for a slot pauses the least urgent decode
#   fcfs    beside the batch load, first come first served (no preemption): the comparison
# Prints each run's table and the interactive TTFT p99 against its target and against alone.
#   MODEL_DIR   a model directory for the mock (default: `kvfabric model-dir` writes one)
#   KVFABRIC    the binary (default target/release/kvfabric)
#   REQUESTS    requests per run (default 200, about 100 s)
#   RUNS        which runs (default "alone edf fcfs")
set -euo pipefail
cd "$(dirname "$0")/.."
K=${KVFABRIC:-target/release/kvfabric}
REQUESTS=${REQUESTS:-200}
RUNS=${RUNS:-alone edf fcfs}
PORT=${PORT:-18731}
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT
MODEL_DIR=${MODEL_DIR:-$out/model}
[ -f "$MODEL_DIR/tokenizer.json" ] || "$K" model-dir --out "$MODEL_DIR" >/dev/null

INTERACTIVE=interactive:share=0.5,prompt=40,output=1,ttft=300ms,itl=50ms
BATCH=batch:share=0.5,prompt=200,output=600,ttft=30s

run() {
  local name=$1 policy=$2
  shift 2
  "$K" up --engine mock --model-dir "$MODEL_DIR" --port "$PORT" --max-batch 4 \
    --disk-blocks 0 --queue-policy "$policy" \
    --class interactive:ttft=300ms,itl=50ms --class batch:ttft=30s,default \
    >"$out/up.log" 2>&1 &
  local up=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.1; done
  echo "== $name ($policy)"
  "$K" bench serve --url "http://127.0.0.1:$PORT" --concurrency 1000 --warmup 10 \
    --json-out "$out/$name.json" "$@"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kvfabric_engine_preempted_total' || true
  kill "$up"
  wait "$up" 2>/dev/null || true
}

for r in $RUNS; do
  case "$r" in
    alone) run alone edf --mix "$INTERACTIVE" --rate 1 --requests $((REQUESTS / 2)) ;;
    edf) run edf edf --mix "$BATCH" --mix "$INTERACTIVE" --rate 2 --requests "$REQUESTS" ;;
    fcfs) run fcfs fcfs --mix "$BATCH" --mix "$INTERACTIVE" --rate 2 --requests "$REQUESTS" ;;
    *) echo "unknown run $r" >&2; exit 2 ;;
  esac
done

python3 - "$out" $RUNS <<'EOF'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
rows = {}
for r in runs:
    for line in open(f"{out}/{r}.json"):
        row = json.loads(line)
        rows[(r, row["class"])] = row
def p99(r):
    row = rows.get((r, "interactive"))
    return row and row["ttft_ms"][2]
alone = p99("alone")
for r in runs:
    v = p99(r)
    if v is None:
        continue
    vs = f", {v / alone:.2f}x alone" if alone and r != "alone" else ""
    print(f"{r}: interactive TTFT p99 {v:.1f} ms (target 300 ms{vs})")
    b = rows.get((r, "batch"))
    if b:
        print(f"{r}: batch {b['throughput_rps']:.2f} req/s, {b['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {b['ttft_ms'][0]:.0f} ms")
EOF
