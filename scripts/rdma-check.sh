#!/usr/bin/env bash
# The RDMA checks, for a host with an RDMA device (InfiniBand, or RoCE) and rdma-core's
# libibverbs1, but no Rust toolchain.
#
#   scripts/rdma-check.sh build [DIR]   here (with cargo): the RDMA test binary (its hardware
#                                       tests are ignored without a device) and the release
#                                       `kvfabric` binary, stripped, into DIR (default
#                                       dist/rdma-check)
#   scripts/rdma-check.sh run [DIR]     on the RDMA host: lists the devices, runs every RDMA
#                                       test (the ignored ones included), then the rdma rows of
#                                       `kvfabric bench transfer` (two processes: this one and
#                                       its `kvfabric peer`) against the plain verbs loop of the
#                                       same bytes, and with a GPU the same rows between GPU
#                                       memory (GPUDirect RDMA, `--gpu`); logs and JSON rows go
#                                       to $OUT when set, else DIR/results
#
# Exit status: non-zero when a test fails or no device is usable. Each step has a deadline.
set -euo pipefail
cmd="${1:-}"
dir="${2:-dist/rdma-check}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

case "$cmd" in
  build)
    cd "$(dirname "$0")/.."
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/kvfabric/target}"
    # The hardware tests (tests/it/rdma.rs) and the library's unit tests (the verbs ABI against
    # the RDMA host's own verbs.h, the exchange, the planning, the software-device tests).
    built="$(cargo test -p kvfabric --features cuda --lib --test it --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["executable"])')"
    while read -r kind exe; do
      case "$kind" in
        lib) cp "$exe" "$dir/kvfabric-unit-tests" ;;
        test) cp "$exe" "$dir/rdma-tests" ;;
      esac
    done <<<"$built"
    [ -x "$dir/rdma-tests" ] && [ -x "$dir/kvfabric-unit-tests" ] ||
      { echo "rdma-check: the RDMA test binaries were not built" >&2; exit 1; }
    cargo build --release -p kvfabric-cli --quiet
    cp "$CARGO_TARGET_DIR/release/kvfabric" "$dir/kvfabric"
    strip "$dir/rdma-tests" "$dir/kvfabric-unit-tests" "$dir/kvfabric"
    cp "$0" "$dir/rdma-check.sh"
    du -sh "$dir"
    ;;
  run)
    out="${OUT:-$dir/results}"
    mkdir -p "$out"
    status=0
    (ibv_devinfo 2>&1 || ls /sys/class/infiniband 2>&1 || true) | tee "$out/devices.txt"
    echo "== the RDMA unit tests (verbs ABI against this host's verbs.h, software device)"
    timeout 300 "$dir/kvfabric-unit-tests" transport::rdma 2>&1 | tee "$out/rdma-unit-tests.log" ||
      status=1
    echo "== RDMA tests (the hardware ones included)"
    timeout 300 "$dir/rdma-tests" rdma:: --include-ignored --test-threads 1 2>&1 | tee "$out/rdma-tests.log" ||
      status=1
    echo "== kvfabric bench transfer --transports rdma"
    timeout 600 "$dir/kvfabric" bench transfer --transports rdma,tcp \
      --sizes 4K,64K,1M,4M,64M --batches 1,16,256 --max-transfer-mib 1024 --json \
      >"$out/bench-transfer.json" 2>"$out/bench-transfer.log" || status=1
    timeout 600 "$dir/kvfabric" bench transfer --transports rdma \
      --sizes 4K,64K,1M,4M,64M --batches 1,16,256 --max-transfer-mib 1024 2>&1 |
      tee "$out/bench-transfer.txt" || status=1
    echo "== kvfabric bench transfer --transports rdma --gpu (GPUDirect RDMA; hosts with a GPU)"
    if command -v nvidia-smi >/dev/null 2>&1; then
      timeout 600 "$dir/kvfabric" bench transfer --transports rdma --gpu \
        --sizes 4K,64K,1M,4M,64M --batches 1,16,256 --max-transfer-mib 1024 2>&1 |
        tee "$out/bench-transfer-gpu.txt" ||
        echo "no GPUDirect rows: the reason is above (not a failure of the RDMA checks)"
    else
      echo "no GPU here (nvidia-smi not found): no GPUDirect rows" | tee "$out/bench-transfer-gpu.txt"
    fi
    exit $status
    ;;
  *)
    echo "usage: scripts/rdma-check.sh build|run [DIR]" >&2
    exit 2
    ;;
esac
