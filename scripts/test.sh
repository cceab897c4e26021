#!/usr/bin/env bash
# Runs every test of the workspace on a fresh Debian 12 machine of this kind, installing what
# the tests need when it is missing: the apt packages (protobuf-compiler, etcd-server,
# nats-server, build libraries), cargo-nextest if absent, and the default model; then the
# Python binding's tests in a virtual environment (numpy, pytest).
#   CARGO_TARGET_DIR   reused when set (CI points it outside the clone)
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
# etcd-client's build compiles etcd's protos, which import protobuf's well-known types.
[ -f /usr/include/google/protobuf/descriptor.proto ] || need_apt+=(libprotobuf-dev)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v nats-server >/dev/null 2>&1 || need_apt+=(nats-server)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing: ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
fi

# The default model (SmolLM2-135M GGUF): real-model tests read it.
KVFABRIC_TEST_MODEL="$(scripts/fetch-model.sh)"
export KVFABRIC_TEST_MODEL

status=0
if cargo nextest --version >/dev/null 2>&1; then
  # nextest does not run doctests: run them first, so that nextest's summary closes the log.
  cargo test --workspace --doc --quiet
  cargo nextest run --workspace --no-fail-fast --failure-output final "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi

# The Python binding over the C ABI (the C tests themselves run under cargo: ffi/tests).
scripts/test-python.sh || status=$?
exit $status
