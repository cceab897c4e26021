#!/usr/bin/env bash
# The full fault matrix of "many machines", outside CI (about 5 minutes): the deployment of
# `scripts/cluster.sh up` on 16 namespace hosts (the mock engine everywhere, leases of 3 s)
# through every fault, each under load through both frontends, compared token for token with a
# quiet run. Prints the results table (the one in docs/deploy.md) and writes it to
# ${KVF_MATRIX_OUT:-target/cluster-matrix.md}. Needs root, etcd and nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVF_MATRIX_OUT="${KVF_MATRIX_OUT:-$PWD/target/cluster-matrix.md}"
mkdir -p "$(dirname "$KVF_MATRIX_OUT")"
cargo nextest run -p kvfabric-cli --test it --run-ignored ignored-only --no-capture \
    hosts::fault_matrix_of_the_whole_deployment
echo "table: $KVF_MATRIX_OUT"
