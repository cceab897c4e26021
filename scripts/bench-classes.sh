#!/usr/bin/env bash
# Service classes under overload: `kvfabric up --engine mock` with 4 workers, a mix of
# interactive chat turns (10%: a shared 400-token system prompt, 20-60 tokens of their own,
# 32 tokens out; TTFT 300 ms, ITL 50 ms) and batch jobs (90%: 2-8k-token prompts, 16 tokens
# out; TTFT 30 s) offered at RATE requests/s, four ways:
#   alone    the interactive requests alone (their share of RATE), with classes on;
#   edf      classes on, earliest deadline first (the default);
#   fcfs     the same classes, first come first served (same capacity, no reordering);
#   off      no classes at all (the request names none).
# Prints `kvfabric bench serve --mix` per run. RATE should be about 1.5x what the deployment
# serves: CALIBRATE=1 measures that first (batch-only at an overload rate).
#
#   MODEL_DIR=... scripts/bench-classes.sh        # RATE=19 REQUESTS=900, every run
#   RUNS="alone edf" MODEL_DIR=... scripts/bench-classes.sh
#   KVFABRIC=target/release/kvfabric RATE=18 scripts/bench-classes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
K=${KVFABRIC:-${CARGO_TARGET_DIR:-target}/debug/kvfabric}
MODEL_DIR=${MODEL_DIR:?a Hugging Face model directory (tokenizer.json, config.json) for the mock, e.g. SmolLM2-135M}
RATE=${RATE:-19}
REQUESTS=${REQUESTS:-900}
PORT=${PORT:-8100}
RUNS=${RUNS:-alone edf fcfs off}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT

INTERACTIVE="interactive:share=0.1,prefix=400,prompt=20-60,output=32,ttft=300ms,itl=50ms"
BATCH="batch:share=0.9,prompt=2000-8000,output=16,ttft=30s"
CLASSES=(--class interactive:ttft=300ms,itl=50ms --class batch:ttft=30s,default)

up() {
  rm -rf "$WORK/data"
  "$K" up --engine mock --model-dir "$MODEL_DIR" --workers 4 --port "$PORT" \
    --data-dir "$WORK/data" "$@" >"$WORK/up.log" 2>&1 &
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 0.5
  done
  cat "$WORK/up.log" >&2
  return 1
}

down() {
  kill "$(jobs -p)" 2>/dev/null || true
  wait 2>/dev/null || true
}

bench() {
  "$K" bench serve --url "http://127.0.0.1:$PORT" --timeout-s 120 --seed 7 "$@"
}

if [[ -n ${CALIBRATE:-} ]]; then
  echo "== calibration: batch alone at an overload rate"
  up "${CLASSES[@]}"
  bench --mix "${BATCH/share=0.9/share=1}" --rate 40 --requests 300
  down
fi

for run in $RUNS; do
  case $run in
  alone)
    echo "== alone: the interactive requests without the batch load"
    up "${CLASSES[@]}"
    ALONE_RATE=$(python3 -c "print($RATE * 0.1)")
    bench --mix "${INTERACTIVE/share=0.1/share=1}" --rate "$ALONE_RATE" --requests $((REQUESTS / 10))
    ;;
  edf)
    echo "== edf: classes on, earliest deadline first"
    up "${CLASSES[@]}"
    bench --mix "$INTERACTIVE" --mix "$BATCH" --rate "$RATE" --requests "$REQUESTS"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kvfabric_engine_(preempted|shed|expired)_total' || true
    ;;
  fcfs)
    echo "== fcfs: the same classes, first come first served"
    up "${CLASSES[@]}" --queue-policy fcfs
    bench --mix "$INTERACTIVE" --mix "$BATCH" --rate "$RATE" --requests "$REQUESTS"
    ;;
  off)
    echo "== off: no classes"
    up
    bench --mix "$INTERACTIVE" --mix "$BATCH" --rate "$RATE" --requests "$REQUESTS" --no-class-header
    ;;
  *) echo "unknown run $run (alone, edf, fcfs, off)" >&2; exit 2 ;;
  esac
  down
done
