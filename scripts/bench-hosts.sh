#!/usr/bin/env bash
# What crossing hosts costs, and a shaped link against the planner (outside CI, as root):
#  1. `cluster.sh up` on 16 namespace hosts; `bench serve` through both frontends (the mock
#     model of w1-w4);
#  2. the prefill/decode pair (SmolLM2, f32) with the decode host's link shaped to
#     ${KVF_LINK:-1gbit}: prompts of new tokens only, each prefilled on p1 and its KV written
#     to d1 over that link; the KV bytes, the prefill's compute and wait, and the transfer
#     time against `kvfabric plan`'s for that link;
#  3. the same deployment on one host (KVF_ONE_HOST=1), the same `bench serve`.
# Release binary (built if missing). Prints both bench tables and the link's rows.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${KVFABRIC_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/release/kvfabric}"
[ -x "$bin" ] || cargo build --release -p kvfabric-cli
export KVFABRIC_BIN="$bin"
link=${KVF_LINK:-1gbit}
bench=(bench serve --model mock --concurrency 16,64 --requests 400 --input-words 380 --output-tokens 64)

trap 'scripts/cluster.sh down >/dev/null 2>&1 || true; KVF_ONE_HOST=1 KVF_CLUSTER=kvone KVF_SUBNET=10.78.0 scripts/cluster.sh down >/dev/null 2>&1 || true' EXIT

echo "== 16 hosts"
scripts/cluster.sh up
fe1="http://$(scripts/cluster.sh ip h7):8000"
fe2="http://$(scripts/cluster.sh ip h8):8000"
"$bin" "${bench[@]}" --url "$fe1,$fe2"

echo "== the prefill/decode pair, d1's link shaped to $link"
scripts/cluster.sh shape h16 "$link"
model=$(curl -s "$fe1/v1/models" | python3 -c 'import json,sys; print([m["id"] for m in json.load(sys.stdin)["data"] if m["id"] != "mock"][0])')
python3 - "$fe1" "$model" <<'EOF'
import json, sys, time, urllib.request
fe, model = sys.argv[1], sys.argv[2]
rows = []
for i in range(8):
    # New words from the first token: nothing of it is cached.
    words = " ".join(f"w{i}x{k}" for k in range(300))
    body = json.dumps({"model": model, "prompt": f"{i} {words}", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(fe + "/v1/completions", body, {"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        v = json.load(r)
    ttft = time.time() - t
    rp = v["kvfabric"]["remote_prefill"]
    if rp:
        rows.append((v["usage"]["prompt_tokens"], rp["bytes"], rp["compute_us"] / 1e6, rp["wait_us"] / 1e6, ttft))
print("prompt_tokens  kv_bytes  compute_s  wait_s  transfer_s(wait-compute)  ttft_s")
for p, b, c, w, t in rows:
    print(f"{p:13d} {b:9d} {c:10.3f} {w:7.3f} {w - c:24.3f} {t:7.3f}")
if rows:
    n = len(rows)
    print("mean bytes %.0f, mean transfer %.3f s, mean ttft %.3f s" % (
        sum(r[1] for r in rows) / n, sum(r[3] - r[2] for r in rows) / n, sum(r[4] for r in rows) / n))
EOF
scripts/cluster.sh shape h16 off
scripts/cluster.sh down

# The same with a prefill far faster than the link (the mock engine writing every KV byte of
# SmolLM2's f32 layout): the link is the critical path, as the planner's move time assumes.
echo "== mock prefill/decode pair (full KV), d1's link shaped: 1gbit, then 10gbit"
KVF_MODEL=mock KVF_PD_ARGS="--mock-kv full" scripts/cluster.sh up >/dev/null
for rate in 1gbit 10gbit; do
    scripts/cluster.sh shape h16 "$rate"
    echo "-- $rate"
    python3 - "$fe1" mock-pd <<'EOF'
import json, sys, time, urllib.request
fe, model = sys.argv[1], sys.argv[2]
rows = []
for i in range(8):
    words = " ".join(f"{time.time_ns()}-{k}" for k in range(90))
    body = json.dumps({"model": model, "prompt": words[:1700], "max_tokens": 1}).encode()
    req = urllib.request.Request(fe + "/v1/completions", body, {"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        v = json.load(r)
    ttft = time.time() - t
    rp = v["kvfabric"]["remote_prefill"]
    if rp:
        rows.append((v["usage"]["prompt_tokens"], rp["bytes"], rp["compute_us"] / 1e6, rp["wait_us"] / 1e6, ttft))
rows.sort(key=lambda r: r[4])
for p, b, c, w, t in rows:
    print(f"prompt {p} tokens, KV {b} B, compute {c:.3f} s, wait {w:.3f} s, ttft {t:.3f} s")
if rows:
    m = rows[len(rows) // 2]
    print(f"median: KV {m[1]} B, wait {m[3]:.3f} s, ttft {m[4]:.3f} s")
EOF
done
scripts/cluster.sh down

echo "== the same deployment on one host"
KVF_ONE_HOST=1 KVF_CLUSTER=kvone KVF_SUBNET=10.78.0 scripts/cluster.sh up
one() { KVF_ONE_HOST=1 KVF_CLUSTER=kvone KVF_SUBNET=10.78.0 scripts/cluster.sh "$@"; }
at="http://$(one ip h1)"
"$bin" "${bench[@]}" --url "$at:$(one port frontend-1 8000),$at:$(one port frontend-2 8000)"
