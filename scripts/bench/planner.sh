#!/usr/bin/env bash
# The live planner under a load ramp (issue 22): real etcd and NATS, `kvfabric frontend
# --planner` over local mock workers (SmolLM2's KV layout, 40 µs per prompt token, 8 ms per
# decode step plus 0.2 µs per KV token), profiled first with `kvfabric profile`; then
# `kvfabric bench serve --rate-steps` at a rate that doubles twice and halves twice. Prints
# the ramp's rows (per step: rate, requests, errors, TTFT p99, windows until the TTFT p99 was
# back under the target after a step up) and writes the timeline (SVG), the decision log and
# the profile to OUT (default: a temporary directory, printed).
#
#   scripts/setup.sh test && cargo build --release -p kvfabric-cli && scripts/bench/planner.sh
#
# Takes about four minutes (five steps of 40 s, planner interval 5 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${KVFABRIC_BIN:-${CARGO_TARGET_DIR:-target}/release/kvfabric}"
[ -x "$BIN" ] || { echo "no kvfabric binary at $BIN (cargo build --release -p kvfabric-cli)" >&2; exit 2; }
command -v etcd >/dev/null && command -v nats-server >/dev/null ||
  { echo "etcd and nats-server are needed: scripts/setup.sh test" >&2; exit 2; }
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT

STEP_S="${STEP_S:-40}"
INTERVAL_S="${INTERVAL_S:-5}"
TTFT_MS="${TTFT_MS:-250}"
ITL_MS="${ITL_MS:-40}"
BASE_RATE="${BASE_RATE:-4}"
MOCK="--engine mock --disk-blocks 0 --max-batch 8 --mock-prefill-us 40 --mock-decode-us 8000 --mock-decode-kv-us 0.2"

echo "profiling the mock worker ..."
# shellcheck disable=SC2086
"$BIN" profile $MOCK --prompts 128,512,1024 --batches 1,2,4,8 --contexts 512,1024 \
  --decode-tokens 16 --reps 2 --tiers none --out "$OUT/profile.json" --plot "$OUT/profile.svg" \
  --log-level warn | tail -1

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
EP=$(port); PP=$(port); NP=$(port); FP=$(port)
etcd --data-dir "$TMP/etcd" --listen-client-urls "http://127.0.0.1:$EP" \
  --advertise-client-urls "http://127.0.0.1:$EP" --listen-peer-urls "http://127.0.0.1:$PP" \
  >"$TMP/etcd.log" 2>&1 &
PIDS+=($!)
nats-server -a 127.0.0.1 -p "$NP" >"$TMP/nats.log" 2>&1 &
PIDS+=($!)
sleep 1

rm -f "$OUT/decisions.jsonl"
"$BIN" frontend --port "$FP" --secret "planner-bench-$RANDOM" --namespace planner-bench \
  --etcd "http://127.0.0.1:$EP" --nats "nats://127.0.0.1:$NP" \
  --planner "$OUT/profile.json" --planner-min-workers 1 --planner-max-workers 6 \
  --planner-interval-s "$INTERVAL_S" --planner-ttft-ms "$TTFT_MS" --planner-itl-ms "$ITL_MS" \
  --planner-percentile p99 --planner-worker-args "$MOCK --lease-ttl-s 3" \
  --planner-log "$OUT/decisions.jsonl" >"$TMP/frontend.out" 2>"$OUT/frontend.log" &
FRONT=$!
PIDS+=($FRONT)
for _ in $(seq 300); do
  grep -q "kvfabric frontend at" "$TMP/frontend.out" 2>/dev/null && break
  sleep 0.2
done
grep -q "kvfabric frontend at" "$TMP/frontend.out" || { tail -5 "$OUT/frontend.log" >&2; exit 1; }

R=$BASE_RATE
STEPS="$R:$STEP_S,$((2 * R)):$STEP_S,$((4 * R)):$STEP_S,$((2 * R)):$STEP_S,$R:$STEP_S"
echo "ramp: $STEPS (requests/s:seconds), 128-word prompts, 64 tokens out; TTFT p99 target $TTFT_MS ms, ITL $ITL_MS ms, planner interval $INTERVAL_S s"
"$BIN" bench serve --url "http://127.0.0.1:$FP" --rate-steps "$STEPS" --concurrency 512 \
  --input-words 128 --output-tokens 64 --window-s "$INTERVAL_S" --ttft-target-ms "$TTFT_MS" \
  --planner-log "$OUT/decisions.jsonl" --request-log "$OUT/trace.jsonl" --plot "$OUT/timeline.svg"
echo
echo "decisions:"
python3 - "$OUT/decisions.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
t0 = rows[0]["at_unix_ms"] if rows else 0
for d in rows:
    if d["action"] != "hold":
        print(f'  {(d["at_unix_ms"] - t0) / 1000:6.1f} s  {d["action"]:>4}  {d["before"]} -> {d["after"]}  '
              f'(observed {d["observed"]["rate"]:.1f} req/s, predicted {d["predicted"]["rate"]:.1f})')
PY
kill -TERM "$FRONT"
wait "$FRONT" || true
echo "workers left after the frontend stopped: $(pgrep -fc 'frontend-0-w-' || true)"
echo "files: $OUT (timeline.svg, decisions.jsonl, trace.jsonl, profile.json, profile.svg, frontend.log)"
