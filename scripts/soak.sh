#!/usr/bin/env bash
# Soak under chaos: a frontend and two mock workers over real etcd and NATS, `bench serve`
# in a loop for SECONDS (default 600), while a chaos loop kills -9 and restarts workers,
# restarts NATS and opens hostile connections. Prints, at the end: requests, errors, the
# worst e2e p99 of any round (against the 30 s request deadline) and the memory of every
# process over time.
#
#   scripts/setup.sh test && cargo build -p kvfabric-cli && scripts/soak.sh 600
#
# (`kvfabric up` runs its workers in its own process, where kill -9 of one worker is not
# possible: the soak runs the distributed deployment, which also exercises etcd and NATS.)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TOTAL="${1:-600}"
BIN="${KVFABRIC_BIN:-${CARGO_TARGET_DIR:-target}/debug/kvfabric}"
[ -x "$BIN" ] || { echo "no kvfabric binary at $BIN (cargo build -p kvfabric-cli)" >&2; exit 2; }
command -v etcd >/dev/null && command -v nats-server >/dev/null ||
  { echo "etcd and nats-server are needed: scripts/setup.sh test" >&2; exit 2; }

TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ -f "$TMP/nats.pid" ] && kill -9 "$(cat "$TMP/nats.pid")" 2>/dev/null || true
  for f in "$TMP"/w*.pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
EP=$(port); PP=$(port); NP=$(port); FP=$(port)
SECRET="soak-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export KVFABRIC_SECRET="$SECRET" KVFABRIC_ETCD="http://127.0.0.1:$EP" KVFABRIC_NATS="nats://127.0.0.1:$NP"
export KVFABRIC_NAMESPACE="soak" KVFABRIC_LOG_LEVEL=warn

etcd --data-dir "$TMP/etcd" --listen-client-urls "http://127.0.0.1:$EP" \
  --advertise-client-urls "http://127.0.0.1:$EP" --listen-peer-urls "http://127.0.0.1:$PP" \
  >"$TMP/etcd.log" 2>&1 &
PIDS+=($!)
start_nats() {
  nats-server -a 127.0.0.1 -p "$NP" -js -sd "$TMP/nats" >>"$TMP/nats.log" 2>&1 &
  # In a file: the chaos loop restarts NATS from a subshell, and cleanup must find the last.
  echo $! >"$TMP/nats.pid"
}
start_nats
sleep 1

start_worker() { # name
  "$BIN" worker --name "$1" --engine mock --disk-blocks 0 --listen 127.0.0.1:0 \
    --lease-ttl-s 3 --mock-decode-us 2000 --mock-prefill-us 20 >"$TMP/$1.out" 2>>"$TMP/$1.log" &
  echo $! >"$TMP/$1.pid"
}
start_worker w0
start_worker w1
"$BIN" frontend --port "$FP" --request-timeout-s 30 --first-token-timeout-s 5 \
  >"$TMP/frontend.out" 2>"$TMP/frontend.log" &
FRONT=$!
PIDS+=($FRONT)
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$FP/health" >/dev/null 2>&1 && break
  sleep 0.2
done

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
worker_port() { sed -n 's/.*"addr":"[^:]*:\([0-9]*\)".*/\1/p' "$TMP/$1.out" | head -1; }

END=$((SECONDS + SECONDS_TOTAL))
# Chaos: every 20 s, in turn: kill -9 a worker and restart it, restart NATS, hostile
# connections (idle sockets on the frontend, garbage and unauthenticated frames on a worker).
(
  n=0
  while [ $SECONDS -lt $END ]; do
    sleep 20
    case $((n % 3)) in
      0) w="w$((RANDOM % 2))"; kill -9 "$(cat "$TMP/$w.pid")" 2>/dev/null || true
         echo "$(date +%T) chaos: kill -9 $w" >>"$TMP/chaos.log"
         sleep 3; start_worker "$w" ;;
      1) kill -9 "$(cat "$TMP/nats.pid")" 2>/dev/null || true
         echo "$(date +%T) chaos: restart nats" >>"$TMP/chaos.log"
         sleep 2; start_nats ;;
      2) wp=$(worker_port w0)
         echo "$(date +%T) chaos: hostile connections (frontend $FP, worker ${wp:-none})" >>"$TMP/chaos.log"
         python3 - "$FP" "${wp:-0}" <<'PY' >>"$TMP/chaos.log" 2>&1 || true
import socket, sys, time
fp, wp = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(500):
    try:
        held.append(socket.create_connection(("127.0.0.1", fp), timeout=2))
    except OSError:
        pass
if wp:
    for payload in [b"\xff" * 64, (2**31).to_bytes(4, "little") + b"{", b"\x10\x00\x00\x00{\"model\":\"x\"}"]:
        try:
            s = socket.create_connection(("127.0.0.1", wp), timeout=2)
            s.sendall(payload)
            held.append(s)
        except OSError:
            pass
time.sleep(10)
print(f"held {len(held)} hostile connections for 10 s")
PY
         ;;
    esac
    n=$((n + 1))
  done
) &
CHAOS=$!
PIDS+=($CHAOS)

# Memory, every 10 s.
(
  while [ $SECONDS -lt $END ]; do
    echo "$SECONDS frontend=$(rss $FRONT) w0=$(rss "$(cat "$TMP/w0.pid")") w1=$(rss "$(cat "$TMP/w1.pid")")" >>"$TMP/rss.log"
    sleep 10
  done
) &
PIDS+=($!)

rounds=0
while [ $SECONDS -lt $END ]; do
  "$BIN" bench serve --url "http://127.0.0.1:$FP" --concurrency 4 --requests 40 \
    --turns 2 --prefix-words 100 --input-words 20 --output-tokens 16 --json \
    >>"$TMP/bench.jsonl" 2>>"$TMP/bench.log" || echo '{"failed_round": true}' >>"$TMP/bench.jsonl"
  rounds=$((rounds + 1))
done
wait "$CHAOS" 2>/dev/null || true

echo "== soak: ${SECONDS_TOTAL}s, $rounds rounds of bench serve (concurrency 4, 40 requests)"
python3 - "$TMP/bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = [r for r in rows if "requests" in r]
failed_rounds = sum(1 for r in rows if r.get("failed_round"))
req = sum(r["requests"] for r in ok)
err = sum(r.get("errors", 0) for r in ok)
p99 = max((r["e2e_ms"][2] for r in ok), default=0)
print(f"requests {req}, errors {err} ({100.0 * err / max(req, 1):.2f}%), rounds failed {failed_rounds}")
print(f"worst e2e p99 of a round: {p99:.0f} ms (deadline 30000 ms)")
PY
echo "-- chaos"; cat "$TMP/chaos.log"
echo "-- memory over time (kB RSS, one sample a minute)"
awk 'NR % 6 == 1' "$TMP/rss.log"
echo "-- memory (kB RSS: first, max, last)"
for p in frontend w0 w1; do
  sed -n "s/.*$p=\([0-9]*\).*/\1/p" "$TMP/rss.log" | awk -v p=$p 'NR==1{f=$1} {if($1>m)m=$1; l=$1} END{print p, f, m, l}'
done
echo "-- errors seen by the bench (first 10)"
grep -h -i "error" "$TMP/bench.log" | sort | uniq -c | sort -rn | head -10 || true
