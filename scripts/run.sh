#!/usr/bin/env bash
# The main job. Builds kvfabric (release), fetches the default model when missing, and serves
# it with `kvfabric up` (OpenAI-compatible API on http://127.0.0.1:8000/v1; extra arguments go
# to `kvfabric up`, for example --port 8080 or --engine mock).
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch-model.sh)"
cargo build --release --quiet -p kvfabric-serving --bin kvfabric
bin="${CARGO_TARGET_DIR:-target}/release/kvfabric"
exec "$bin" up --model "$model" "$@"
