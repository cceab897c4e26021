#!/usr/bin/env bash
# The Python binding's tests (python/tests, pytest) against libkvfabric_ffi built here.
# Creates a virtual environment with numpy and pytest when missing.
#   KVFABRIC_VENV      where the environment lives (default ~/.cache/kvfabric/venv)
#   CARGO_TARGET_DIR   the cargo target directory (default ./target)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVFABRIC_VENV:-$HOME/.cache/kvfabric/venv}"
if ! "$venv/bin/python" -c "import numpy, pytest, msgspec, zmq" >/dev/null 2>&1; then
  echo "creating $venv (numpy, pytest, msgspec, pyzmq)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check numpy pytest msgspec pyzmq >&2
fi

cargo build -q -p kvfabric-ffi
export KVFABRIC_LIB="${CARGO_TARGET_DIR:-target}/debug/libkvfabric_ffi.so"
exec "$venv/bin/python" -m pytest -q python/tests "$@"
