#!/usr/bin/env bash
# What TLS costs on this machine, measured in one run:
#   1. `bench transfer --tls`: TCP transfers with and without mutual TLS, against the plain
#      socket and one core's AES-256-GCM rate on the same bytes;
#   2. `bench serve` against `kvfabric up` (zero-delay mock, 2 workers) over HTTP and HTTPS;
#   3. `bench serve` against `kvfabric frontend` and two `kvfabric worker`s (zero-delay mock,
#      etcd and NATS on loopback), without TLS and with TLS on every port (HTTPS on the API,
#      mutual TLS on the request ports and the transfer agents).
#
#   scripts/bench/tls.sh [path/to/kvfabric]     (default: target/release/kvfabric)
#
# Certificates come from scripts/tls-certs.sh (a throwaway CA). Ports 8110-8113 and 23890-23893 on
# 127.0.0.1 must be free. Takes about four minutes.
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

# A CA and one certificate for 127.0.0.1.
scripts/tls-certs.sh "$WORK/tls" local=IP:127.0.0.1
cp "$WORK/tls/ca.pem" "$WORK/ca.pem"
cp "$WORK/tls/local.pem" "$WORK/cert.pem"
cp "$WORK/tls/local.key" "$WORK/key.pem"
TLS=(--tls-cert "$WORK/cert.pem" --tls-key "$WORK/key.pem")

echo "== 1. TCP transfers, with and without mutual TLS"
"$BIN" bench transfer --transports tcp --tls --sizes 64K,1M,16M --batches 1,16 \
    --max-transfer-mib 64 2>/dev/null

"$BIN" model-dir --out "$WORK/model" >/dev/null
ZERO=(--engine mock --model-dir "$WORK/model" --mock-prefill-us 0 --mock-decode-us 0 --mock-decode-kv-us 0 --disk-blocks 0)
LOAD=(--concurrency 16,64 --requests 1000 --input-words 380 --output-tokens 64)
wait_line() { # FILE PATTERN
    for _ in $(seq 150); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        sleep 0.2
    done
    echo "no \"$2\" in $1: $(tail -3 "$1")" >&2
    exit 1
}
stop_all() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}

echo
echo "== 2. kvfabric up --workers 2, zero-delay mock: HTTP, then HTTPS"
for scheme in http https; do
    extra=()
    ca=()
    if [ $scheme = https ]; then extra=("${TLS[@]}"); ca=(--ca "$WORK/ca.pem"); fi
    "$BIN" up "${ZERO[@]}" --workers 2 --port 8110 --data-dir "$WORK/up-$scheme" "${extra[@]}" \
        >"$WORK/up-$scheme.log" 2>&1 &
    PIDS+=($!)
    wait_line "$WORK/up-$scheme.log" "kvfabric is serving"
    echo "$scheme:"
    "$BIN" bench serve --url "$scheme://127.0.0.1:8110" "${ca[@]}" "${LOAD[@]}" 2>/dev/null | tail -3
    stop_all
done

echo
echo "== 3. kvfabric frontend + 2 workers (etcd, NATS on loopback): plaintext, then TLS on every port"
etcd --data-dir "$WORK/etcd" --listen-client-urls http://127.0.0.1:23890 \
    --advertise-client-urls http://127.0.0.1:23890 --listen-peer-urls http://127.0.0.1:23891 \
    --initial-advertise-peer-urls http://127.0.0.1:23891 \
    --initial-cluster default=http://127.0.0.1:23891 >"$WORK/etcd.log" 2>&1 &
PIDS+=($!)
nats-server -a 127.0.0.1 -p 23892 -js -sd "$WORK/nats" >"$WORK/nats.log" 2>&1 &
PIDS+=($!)
sleep 2
CONTROL=(--etcd http://127.0.0.1:23890 --nats nats://127.0.0.1:23892 --secret bench-tls-secret)
for mode in plaintext tls; do
    extra=()
    ca=()
    scheme=http
    if [ $mode = tls ]; then
        extra=("${TLS[@]}" --tls-ca "$WORK/ca.pem")
        ca=(--ca "$WORK/ca.pem")
        scheme=https
    fi
    for w in 1 2; do
        "$BIN" worker --name "w$w-$mode" --namespace "$mode" "${ZERO[@]}" "${CONTROL[@]}" \
            --data-dir "$WORK/w$w-$mode" "${extra[@]}" >"$WORK/w$w-$mode.log" 2>&1 &
        PIDS+=($!)
        wait_line "$WORK/w$w-$mode.log" '"worker"'
    done
    "$BIN" frontend --namespace "$mode" --port 8112 "${CONTROL[@]}" "${extra[@]}" \
        >"$WORK/frontend-$mode.log" 2>&1 &
    PIDS+=($!)
    wait_line "$WORK/frontend-$mode.log" "kvfabric frontend at"
    sleep 2
    echo "$mode:"
    "$BIN" bench serve --url "$scheme://127.0.0.1:8112" "${ca[@]}" "${LOAD[@]}" 2>/dev/null | tail -3
    for p in "${PIDS[@]:2}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]:2}"; do wait "$p" 2>/dev/null || true; done
    PIDS=("${PIDS[@]:0:2}")
done
