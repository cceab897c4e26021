#!/usr/bin/env bash
# The main job. Builds kvfabric (release), fetches the default model when missing, and runs
# it. Until the serving layer lands this is capacity planning for the default model; extra
# arguments go to `kvfabric plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch-model.sh)"
cargo build --release --quiet -p kvfabric-serving --bin kvfabric
bin="${CARGO_TARGET_DIR:-target}/release/kvfabric"
exec "$bin" plan --model "$model" "$@"
