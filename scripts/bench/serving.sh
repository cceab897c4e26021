#!/usr/bin/env bash
# The serving path's benchmarks, each against this machine's own ceiling measured in the same
# run: `kvfabric bench serve` against a no-work streaming server (null-server.py), against
# `kvfabric up --engine mock` mirroring a small model directory at zero delay (with and
# without the disk tier), the shared-prefix workload with kv and round-robin routing (and its
# floor: the same requests one at a time on warm caches), and disaggregated against aggregated
# serving on 2000-token prompts.
#
#   scripts/bench/serving.sh [path/to/kvfabric]     (default: target/release/kvfabric)
#
# Ports 8100-8103 on 127.0.0.1 must be free. Takes about five minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/release/kvfabric}
[ -x "$BIN" ] || { echo "no kvfabric binary at $BIN (cargo build --release -p kvfabric-cli)" >&2; exit 1; }
WORK=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

"$BIN" model-dir --out "$WORK/model" >/dev/null
serve() { # PORT ARGS... -> starts `kvfabric up`, waits for its ready line
    local port=$1
    shift
    "$BIN" up --engine mock --model-dir "$WORK/model" --port "$port" \
        --data-dir "$WORK/data-$port-$RANDOM" "$@" >"$WORK/up-$port.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do
        grep -q "kvfabric is serving" "$WORK/up-$port.log" 2>/dev/null && return 0
        sleep 0.2
    done
    echo "kvfabric up did not start: $(tail -3 "$WORK/up-$port.log")" >&2
    exit 1
}
stop() {
    kill "${PIDS[-1]}" 2>/dev/null || true
    wait "${PIDS[-1]}" 2>/dev/null || true
    unset 'PIDS[-1]'
}
load() { # PORT ARGS... -> one result row of bench serve
    local port=$1
    shift
    "$BIN" bench serve --url "http://127.0.0.1:$port" "$@" 2>/dev/null | tail -1
}
header() { echo " conc errors   req/s out tok/s  in tok/s  cached      TTFT ms p50/p90/p99       ITL ms p50/p90/p99       e2e ms p50/p90/p99"; }
ZERO=(--mock-prefill-us 0 --mock-decode-us 0 --mock-decode-kv-us 0)
ISL=(--concurrency 16 --requests 2000 --input-words 512 --output-tokens 64)

echo "== ISL 512 / OSL 64, c=16, zero-delay mock of a 4-layer, 8 KV heads x 64, bf16 model"
header
python3 scripts/bench/null-server.py --port 8100 >/dev/null 2>&1 &
PIDS+=($!)
sleep 1
echo "no-work streaming server (the ceiling):"
load 8100 "${ISL[@]}"
stop
echo "kvfabric up --workers 2, no disk tier:"
serve 8101 --workers 2 --disk-blocks 0 "${ZERO[@]}"
load 8101 "${ISL[@]}"
stop
echo "kvfabric up --workers 2, disk tier (the default: blocks reused at least once go to disk):"
serve 8101 --workers 2 "${ZERO[@]}"
load 8101 "${ISL[@]}"
stop
echo "kvfabric up --workers 2, disk tier, --disk-admit-min-hits 0 (every evicted block to disk):"
serve 8101 --workers 2 --disk-admit-min-hits 0 "${ZERO[@]}"
load 8101 "${ISL[@]}"
stop

echo
echo "== shared prefixes: 16 system prompts of 1024 words + 64 own words, OSL 64, 4 workers"
echo "   (each worker's host tier holds a quarter of the prefixes, no disk: routing matters;"
echo "   mock prefill 100 us/token, decode step 8 ms)"
SP=(--prefix-words 1024 --prefixes 16 --input-words 64 --output-tokens 64 --seed 7)
SPW=(--workers 4 --disk-blocks 0 --host-blocks 400 --mock-prefill-us 100)
header
for mode in kv round-robin; do
    echo "$mode, c=16:"
    serve 8102 "${SPW[@]}" --router "$mode"
    load 8102 "${SP[@]}" --concurrency 16 --requests 400
    if [ "$mode" = kv ]; then
        echo "kv, c=1 on the warm caches (the floor: new tokens only, never queued):"
        load 8102 "${SP[@]}" --concurrency 1 --requests 100
    fi
    stop
done

echo
echo "== disaggregated vs aggregated, 2000-word prompts, OSL 32 (mock: 40 us/token prefill, 8 ms decode)"
DG=(--input-words 2000 --output-tokens 32)
header
for c in 1 4; do
    echo "aggregated, --workers 2, c=$c:"
    serve 8103 --workers 2
    load 8103 "${DG[@]}" --concurrency "$c" --requests $((c * 10))
    stop
    echo "disaggregated, --prefill-workers 1 --decode-workers 1, c=$c:"
    serve 8103 --prefill-workers 1 --decode-workers 1
    load 8103 "${DG[@]}" --concurrency "$c" --requests $((c * 10))
    stop
done
