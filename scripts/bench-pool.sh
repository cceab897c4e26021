#!/usr/bin/env bash
# One KV pool across hosts, measured (outside CI, as root): a slice of the conversation trace
# replayed online (`bench serve --trace`) through the emulated cluster (`scripts/cluster.sh up`,
# 16 namespace hosts, the mock engine on w1-w4 timed like the trace-agreement test), and the
# same slice and configuration through the simulator (`bench trace`), each of:
#
#   per-worker   each worker's own host tier only (no fabric, no pulls; kv routing)
#   fabric       + the two fabric nodes as every worker's G4 (host evictions go there)
#   pool-LINK    + peer pulls, priced by the router (fabric too), the worker hosts' links
#                shaped to LINK (KVF_LINKS, default "1gbit 25gbit")
#
# For each: reuse (online and simulated: the mean of seeds 1-3), its share of the slice's
# limit, prompt tokens computed, TTFT and ITL percentiles, the bytes each worker and fabric
# host's link carried (both ways) and its peak over any second (sampled from the bridge's
# veth counters every second), the paths the router chose (`kvfabric_router_path_total`), and
# the bytes pulled between workers. Tables to stdout and $KVF_OUT (default
# target/bench-pool/), every raw file beside them.
#
# Settings: KVF_REQUESTS (800), KVF_SPEEDUP (50), KVF_LINKS ("1gbit 25gbit"),
# KVF_CONFIGS (all: "per-worker fabric pool"), KVFABRIC_BIN (release build if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin="${KVFABRIC_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/kvfabric}"
[ -x "$bin" ] || cargo build --release -p kvfabric-cli
export KVFABRIC_BIN="$bin"
export KVF_CLUSTER=${KVF_CLUSTER:-kvpool} KVF_SUBNET=${KVF_SUBNET:-10.79.0} KVF_MODEL=mock
out=${KVF_OUT:-${CARGO_TARGET_DIR:-$root/target}/bench-pool}
mkdir -p "$out"
requests=${KVF_REQUESTS:-800}
speedup=${KVF_SPEEDUP:-50}
links=${KVF_LINKS:-1gbit 25gbit}
configs=${KVF_CONFIGS:-per-worker fabric pool}
shape=(--replay-block-tokens 16 --output-tokens-max 8 --speedup "$speedup")
host_blocks=512
# The fabric nodes: 2 x (2048 host + 4096 disk) blocks of 16 tokens, the simulator's G4.
g4_tokens=$((2 * (2048 + 4096) * 16))
export KVF_MOCK_ARGS="--mock-prefill-us 200 --mock-decode-us 2000 --mock-decode-kv-us 0"
base_worker="--host-blocks $host_blocks --disk-blocks 0 --step-tokens 8192 --max-batch 16"

trap 'scripts/cluster.sh down >/dev/null 2>&1 || true' EXIT

# The slice: the first N requests of the 200 busiest conversations (the trace-agreement
# test's), timestamps from the first.
python3 - benches/traces/conversation_trace.jsonl 200 "$requests" "$out/slice.jsonl" <<'EOF'
import collections, json, sys
src, groups, n, dst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
reqs = [json.loads(l) for l in open(src)]
key = lambda r: tuple(r["hash_ids"][:2]) if len(r["hash_ids"]) >= 2 else None
count = collections.Counter(k for k in map(key, reqs) if k)
keep = {k for k, _ in sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))[:groups]}
sl = [r for r in reqs if key(r) in keep][:n]
t0 = sl[0]["timestamp"]
with open(dst, "w") as f:
    for r in sl:
        f.write(json.dumps(dict(r, timestamp=r["timestamp"] - t0)) + "\n")
EOF

hosts_of_links="h9 h10 h11 h12 h13 h14"

# online NAME LINK WORKER-FLAGS FRONTEND-FLAGS REMOTE-TIER
online() {
    local name=$1 link=$2 wflags=$3 fflags=$4 remote=$5
    echo "== online: $name (links $link)" >&2
    KVF_WORKER_ARGS="$base_worker $wflags" KVF_FRONTEND_ARGS="$fflags" KVF_REMOTE_TIER="$remote" \
        scripts/cluster.sh up >/dev/null
    local h
    if [ "$link" != off ]; then
        for h in $hosts_of_links; do scripts/cluster.sh shape "$h" "$link"; done
    fi
    local fe
    fe="http://$(scripts/cluster.sh ip h7):8000"
    if [ ! -f "$out/profile.json" ]; then
        echo "   profiling the mock workers through the frontend" >&2
        "$bin" profile --url "$fe" --served-model-name mock --prompts 16,64,256,1024 --batches 1,4,16 \
            --contexts 256,1024 --decode-tokens 16 --tiers none --out "$out/profile.json" >/dev/null
    fi
    # Link counters every second, on this machine's side of each host's veth.
    python3 - "$KVF_CLUSTER" "$out/$name.links.jsonl" $hosts_of_links <<'EOF' &
import json, sys, time
c, dst, hosts = sys.argv[1], sys.argv[2], sys.argv[3:]
def read():
    # rx on this machine's end of a host's veth: what the host sent; tx: what it received.
    v = {}
    for h in hosts:
        d = f"/sys/class/net/{c}-v{h[1:]}/statistics/"
        v[h] = [int(open(d + k).read()) for k in ("rx_bytes", "tx_bytes")]
    return v
with open(dst, "w") as f:
    while True:
        f.write(json.dumps({"t": time.time(), "bytes": read()}) + "\n")
        f.flush()
        time.sleep(1)
EOF
    local sampler=$!
    curl -fsS "$fe/metrics" >"$out/$name.frontend-before.prom"
    "$bin" bench serve --url "$fe/v1" --model mock --trace "$out/slice.jsonl" --vocab 256 --json \
        "${shape[@]}" >"$out/$name.online.json"
    kill "$sampler" 2>/dev/null || true
    curl -fsS "$fe/metrics" >"$out/$name.frontend.prom"
    for w in w1 w2 w3 w4; do
        curl -fsS "http://$(scripts/cluster.sh ip "$(scripts/cluster.sh host-of $w)"):9100/metrics" \
            >"$out/$name.$w.prom" || true
    done
    scripts/cluster.sh down >/dev/null
}

# simulated NAME FLAGS...: seeds 1-3.
simulated() {
    local name=$1; shift
    echo "== simulated: $name" >&2
    local seed
    for seed in 1 2 3; do
        "$bin" bench trace "$out/slice.jsonl" --workers 4 --g1-tokens $((host_blocks * 16)) \
            --g1-tier host --split-steps --profile "$out/profile.json" --batch-max 16 \
            --model smollm2-135m --dtype f32 --json --seed "$seed" "${shape[@]}" "$@" \
            >"$out/$name.sim$seed.json"
    done
}

rm -f "$out/profile.json" "$out/runs"
for c in $configs; do
    case "$c" in
        per-worker)
            online per-worker off "--peer-pulls false" "--router-pulls false" false
            simulated per-worker
            echo per-worker >>"$out/runs"
            ;;
        fabric)
            online fabric off "--peer-pulls false" "--router-pulls false" true
            simulated fabric --g4-tokens "$g4_tokens" --g4-on-evict
            echo fabric >>"$out/runs"
            ;;
        pool)
            for link in $links; do
                # The router prices pulls at the shaped rate until the workers measure theirs.
                l=${link%bit}
                online "pool-$link" "$link" "--peer-pulls true" "--router-pulls true --router-pull-link $l" true
                simulated "pool-$link" --g4-tokens "$g4_tokens" --g4-on-evict --peer-pulls \
                    --peer-link "$l" --g4-link "$l"
                echo "pool-$link" >>"$out/runs"
            done
            ;;
        *) echo "unknown config $c" >&2; exit 2 ;;
    esac
done

# What the planner predicts the pool's hits need over the fabric's links, at this speed-up,
# timed by the engine profiled above (the trace at 512 tokens an id, replayed at 16 as above).
"$bin" plan --model smollm2-135m --dtype f32 --trace "$out/slice.jsonl" --trace-block-tokens 512 \
    --replay-block-tokens 16 --output-tokens-max 8 --workers 4 \
    --cache-tokens $((host_blocks * 16 * 32)) --speedup "$speedup" --g4-on-evict \
    --profile "$out/profile.json" --link 25g --json >"$out/plan.json"
python3 scripts/bench-pool-report.py "$out" | tee "$out/table.md"
