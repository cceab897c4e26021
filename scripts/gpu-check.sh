#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU and driver but no Rust toolchain.
#
#   scripts/gpu-check.sh build [DIR]   here (with cargo): builds the GPU test binaries and the
#                                      release `kvfabric` binary (feature cuda, driver loaded at
#                                      run time), the C ABI library and the Python wheel
#                                      with its GPU test, stripped, into DIR (default
#                                      dist/gpu-check)
#   scripts/gpu-check.sh run [DIR]     on the GPU machine: runs every CUDA test (the ones that
#                                      are ignored without a GPU) with KVFABRIC_EXPECT_CUDA=1, so
#                                      a broken driver fails instead of skipping, then the cuda
#                                      rows of `kvfabric bench transfer` and the G1 rows of
#                                      `kvfabric bench tier`; results (logs, JSON rows) go to
#                                      $OUT when set, else DIR/results
#
# Exit status: non-zero when a test fails or CUDA is missing on the GPU machine. Each step has a
# deadline (timeout), so a hung driver call cannot eat the whole lease.
set -euo pipefail
cmd="${1:-}"
dir="${2:-dist/gpu-check}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

case "$cmd" in
  build)
    cd "$(dirname "$0")/.."
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/kvfabric/target}"
    # The GPU tests: the module cuda of kvfabric's integration tests (tests/it/cuda.rs) and
    # device_tier of kvfabric-tiers'. Each crate has one test binary; its path comes from
    # cargo's JSON messages, and the binary is named for the module that it runs.
    built="$(cargo test -p kvfabric -p kvfabric-tiers --features kvfabric/cuda,kvfabric-tiers/cuda \
        --test it --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        tiers = "/tiers/" in m["manifest_path"]
        print("device_tier" if tiers else "cuda", m["executable"])')"
    rm -f "$dir"/*-tests
    while read -r name exe; do
      cp "$exe" "$dir/$name-tests"
    done <<<"$built"
    [ -x "$dir/cuda-tests" ] && [ -x "$dir/device_tier-tests" ] ||
      { echo "gpu-check: the GPU test binaries were not built" >&2; exit 1; }
    cargo build --release -p kvfabric-cli -p kvfabric-ffi --quiet
    cp "$CARGO_TARGET_DIR/release/kvfabric" "$dir/kvfabric"
    cp "$CARGO_TARGET_DIR/release/libkvfabric_ffi.so" "$dir/libkvfabric_ffi.so"
    strip "$dir"/*-tests "$dir/kvfabric" "$dir/libkvfabric_ffi.so"
    # The Python package as users install it (the wheel), and its GPU test (CUDA torch
    # tensors through the C ABI).
    rm -f "$dir"/kvfabric-*.whl
    DIST="$dir" scripts/build-wheel.sh
    rm -rf "$dir/python" && mkdir -p "$dir/python/tests"
    cp ffi/python/tests/conftest.py ffi/python/tests/test_gpu.py "$dir/python/tests/"
    cp "$0" "$dir/gpu-check.sh"
    du -sh "$dir"
    ;;
  run)
    out="${OUT:-$dir/results}"
    mkdir -p "$out"
    status=0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1 || true
    cat "$out/nvidia-smi.txt"
    uname -r; ldd --version 2>&1 | sed -n 1p
    for t in "$dir"/*-tests; do
      name="$(basename "$t")"
      echo "== $name"
      KVFABRIC_EXPECT_CUDA=1 timeout 240 "$t" "${name%-tests}::" --include-ignored --test-threads 1 2>&1 |
        tee "$out/$name.log" || status=1
      grep -q "test result: ok" "$out/$name.log" || status=1
    done
    echo "== python: the wheel installed, CUDA torch tensors through the C ABI"
    rm -rf "$dir/site"
    python3 -m pip install -q --no-deps --no-index --target "$dir/site" "$dir"/kvfabric-*.whl || status=1
    (cd "$dir/python" && env -u KVFABRIC_LIB PYTHONPATH="$dir/site" KVFABRIC_TEST_INSTALLED=1 \
      KVFABRIC_EXPECT_CUDA=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1) |
      tee "$out/python-gpu.log" || status=1
    grep -q " passed" "$out/python-gpu.log" || status=1
    echo "== bench transfer --transports cuda"
    timeout 180 "$dir/kvfabric" bench transfer --transports cuda --sizes 64K,1M,4M,64M --batches 1,16,256 \
      --max-transfer-mib 1024 --min-time-ms 200 --json --log-level warn \
      >"$out/bench-transfer-cuda.jsonl" 2>"$out/bench-transfer-cuda.err" || status=1
    cat "$out/bench-transfer-cuda.err"
    python3 - "$out/bench-transfer-cuda.jsonl" <<'EOF' || true
import json, sys
print(f"{'op':>4} {'desc':>8} {'batch':>5} {'GB/s':>7} {'limit':>7} {'ratio':>6}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['op']:>4} {r['desc_bytes']:>8} {r['batch']:>5} {r['gbps']:>7.2f} {r['limit_gbps']:>7.2f} {r['ratio_to_limit']:>5.2f}x")
EOF
    echo "== bench tier --g1-only"
    timeout 120 "$dir/kvfabric" bench tier --g1-only --models smollm2-135m,llama-3.1-8b --depths 1,8,32 \
      --total-mib 256 --reps 2 --log-level warn 2>&1 | tee "$out/bench-tier-g1.txt" || status=1
    exit $status
    ;;
  *)
    echo "usage: scripts/gpu-check.sh build|run [DIR]" >&2
    exit 2
    ;;
esac
