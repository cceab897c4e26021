#!/usr/bin/env bash
# Nothing in the clear between the hosts of `scripts/cluster.sh`, checked on the wire, outside
# CI (about 4 minutes; needs root, etcd, nats-server, openssl, python3).
#
# Twice: the deployment without TLS, then with KVF_TLS=1 (TLS on every port, etcd and NATS
# authenticated). Each time, every frame on every host's link (the bridge's veths) is
# captured (a raw packet socket, no tcpdump needed) while requests carrying a marker phrase go
# through both frontends, to the mock workers (w1-w4, KV through the fabric nodes) and to the
# prefill/decode pair (KV from p1 to d1). The capture is then searched for the prompt, for
# its answers and for the secrets of the deployment.
#
# Without TLS the marker must be found (the capture works and sees the traffic); with TLS it,
# the answers and the secrets must not be, and the TLS records must carry the bytes.
#
#   sudo scripts/cluster-tls-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export KVF_CLUSTER=${KVF_CLUSTER:-kvtls} KVF_SUBNET=${KVF_SUBNET:-10.78.0} KVF_MODEL=mock
export KVF_WORKER_ARGS="--host-blocks 32 --disk-blocks 0"
DIR=/tmp/kvfabric-cluster-$KVF_CLUSTER
OUT=${KVF_TLS_CHECK_OUT:-$PWD/target/cluster-tls-check}
mkdir -p "$OUT"
MARKER="Zanzibar marmalade recipe of the lighthouse keeper"

capture() { # IFACE-PREFIX FILE SECONDS: every frame on the interfaces with that prefix
    python3 - "$1" "$2" "$3" <<'EOF'
import socket, sys, time
prefix, out, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
s.settimeout(0.2)
end = time.time() + secs
n = total = 0
with open(out, "wb") as f:
    while time.time() < end and total < (1 << 30):
        try:
            frame, addr = s.recvfrom(65535)
        except socket.timeout:
            continue
        if not addr[0].startswith(prefix):
            continue
        f.write(len(frame).to_bytes(4, "little") + frame)
        n += 1
        total += len(frame)
print(f"{n} frames, {total} bytes", file=sys.stderr)
EOF
}

requests() { # SCHEME: requests with the marker through both frontends, both models
    local s=$1 fe i model
    for i in 1 2 3 4 5 6; do
        for fe in frontend-1 frontend-2; do
            for model in mock mock-pd; do
                scripts/cluster.sh curl -fsS -m 60 \
                    "$s://$(scripts/cluster.sh ip "$(scripts/cluster.sh host-of $fe)"):8000/v1/completions" \
                    -H 'Content-Type: application/json' \
                    -d "{\"model\": \"$model\", \"prompt\": \"$MARKER, part $i: $(printf 'the lighthouse %.0s' $(seq 1 60))\", \"max_tokens\": 16}" \
                    >>"$OUT/answers-$s.jsonl" || echo "request failed ($fe, $model)" >&2
                echo >>"$OUT/answers-$s.jsonl"
            done
        done
    done
}

search() { # FILE NEEDLE... -> the needles found in the captured frames
    python3 - "$@" <<'EOF'
import sys
data = open(sys.argv[1], "rb").read()
for needle in sys.argv[2:]:
    if needle and needle.encode() in data:
        print(needle)
EOF
}

run() { # plain|tls
    local mode=$1 s=http
    [ "$mode" = tls ] && s=https
    scripts/cluster.sh down >/dev/null 2>&1 || true
    rm -f "$OUT/answers-$s.jsonl"
    if [ "$mode" = tls ]; then KVF_TLS=1 scripts/cluster.sh up >"$OUT/up-$mode.txt"; else scripts/cluster.sh up >"$OUT/up-$mode.txt"; fi
    capture "$KVF_CLUSTER-v" "$OUT/capture-$mode.bin" 40 2>"$OUT/capture-$mode.txt" &
    local cap=$!
    sleep 1
    if [ "$mode" = tls ]; then KVF_TLS=1 requests "$s"; else requests "$s"; fi
    wait $cap
    echo "$mode: captured $(cat "$OUT/capture-$mode.txt")"
    # Answers long enough not to occur by chance.
    mapfile -t answers < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if line:
        t = json.loads(line)["choices"][0]["text"].strip()
        if len(t) >= 12: print(t[:40])' "$OUT/answers-$s.jsonl" | sort -u)
    local secrets=("$(cat "$DIR/etc/secret")")
    if [ "$mode" = tls ]; then
        secrets+=("$(cat "$DIR/etc/etcd-password")" "$(cat "$DIR/etc/nats-password")")
    fi
    found=$(search "$OUT/capture-$mode.bin" "$MARKER" "lighthouse keeper" "${answers[@]}" "${secrets[@]}")
    echo "$mode: ${#answers[@]} distinct answers; found in the capture: ${found:-nothing}"
    FOUND_ANY=$found
}

run plain
[ -n "$FOUND_ANY" ] || { echo "FAIL: without TLS the capture should show the prompt" >&2; scripts/cluster.sh down; exit 1; }
run tls
scripts/cluster.sh down >/dev/null
if [ -n "$FOUND_ANY" ]; then
    echo "FAIL: with TLS on every port, found in the clear: $FOUND_ANY" >&2
    exit 1
fi
echo "PASS: with TLS on every port no prompt, answer or secret crossed the hosts' links in the clear"
