#!/usr/bin/env bash
# Runs every test of the workspace on a fresh Debian 12 machine of this kind, installing what
# the tests need when it is missing (scripts/setup.sh test: etcd-server, nats-server, a C
# compiler, chromium, prometheus, the default model): the alert rules' promtool tests, then
# the Rust tests (with cargo-nextest when it is installed, else cargo test), then the Python
# binding's tests in a virtual environment (numpy, pytest; msgspec and pyzmq for the engine
# stand-ins that publish vLLM- and SGLang-format KV events; playwright for the dashboard's
# browser test).
#   CARGO_TARGET_DIR   reused when set (CI points it outside the clone)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh test

# The default model (SmolLM2-135M GGUF): real-model tests read it.
KVFABRIC_TEST_MODEL="$(scripts/fetch-model.sh)"
export KVFABRIC_TEST_MODEL
# The Python that runs the engine stand-ins (msgspec, pyzmq) of the engine-event tests and
# the dashboard's browser driver (playwright).
KVFABRIC_TEST_PYTHON="${KVFABRIC_VENV:-$HOME/.cache/kvfabric/venv}/bin/python"
export KVFABRIC_TEST_PYTHON

status=0
# The alert rules load, and each fires where it should (promtool's unit tests); the
# real-Prometheus test is cli/tests/prometheus.rs.
promtool check rules deploy/prometheus/alerts.yml >/dev/null || status=$?
promtool test rules deploy/prometheus/alerts.test.yml || status=$?
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
