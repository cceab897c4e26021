#!/usr/bin/env bash
# The main job. Installs what is missing (scripts/setup.sh), builds kvfabric (release), and
# serves the default model with `kvfabric up` (OpenAI-compatible API on
# http://127.0.0.1:8000/v1; extra arguments go to `kvfabric up`, for example --port 8080,
# --engine mock or --log-level debug).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh run
model="$(scripts/fetch-model.sh)"
echo "building kvfabric (release; the first build takes several minutes)..." >&2
cargo build --release --quiet -p kvfabric-cli --bin kvfabric
bin="${CARGO_TARGET_DIR:-target}/release/kvfabric"
exec "$bin" up --model "$model" "$@"
