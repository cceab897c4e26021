#!/usr/bin/env bash
# The Python package's tests (ffi/python/tests, pytest) against the package as users install
# it: the wheel built here (scripts/build-wheel.sh, in the dev profile, reusing the cargo target
# directory), installed into the test environment; not against the source tree. Then the
# wheel in a fresh environment with no Rust toolchain on PATH and no source tree in reach:
# the binding loads the library it ships, and the `kvfabric` command runs.
#   KVFABRIC_VENV      the test environment (default ~/.cache/kvfabric/venv; numpy, pytest...)
#   CARGO_TARGET_DIR   the cargo target directory (default ./target)
#   PROFILE            the wheel's cargo profile (default dev)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVFABRIC_VENV:-$HOME/.cache/kvfabric/venv}"
if ! "$venv/bin/python" -c "import numpy, pytest, msgspec, zmq" >/dev/null 2>&1; then
  echo "creating $venv (numpy, pytest, msgspec, pyzmq)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check numpy pytest msgspec pyzmq >&2
fi

dist="$(mktemp -d)"
trap 'rm -rf "$dist"' EXIT
whl="$(PROFILE="${PROFILE:-dev}" DIST="$dist" scripts/build-wheel.sh)"
echo "built $(basename "$whl") ($(du -h "$whl" | cut -f1))" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$whl" >&2

# The tests import the installed package: the source tree is not on their path (they run
# from elsewhere, and KVFABRIC_LIB is unset so that the package finds the library it ships).
status=0
(cd "$dist" && env -u KVFABRIC_LIB KVFABRIC_TEST_INSTALLED=1 \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$dist" "$OLDPWD/ffi/python/tests" "$@") \
  || status=$?

# A fresh environment, as a user without a Rust toolchain has it: numpy from the package
# index, the wheel, then the library's version through the binding and the command's help.
fresh="$dist/fresh"
python3 -m venv "$fresh"
"$fresh/bin/pip" install -q --disable-pip-version-check "$whl" >&2
(cd "$dist" && env -i HOME="$HOME" PATH="$fresh/bin:/usr/bin:/bin" \
  "$fresh/bin/python" -c 'import kvfabric, sys
v = kvfabric.version()
assert v == kvfabric.__version__, (v, kvfabric.__version__)
assert "site-packages" in kvfabric.__file__, kvfabric.__file__
print("fresh environment: kvfabric", v, "from", kvfabric._ffi._find_library())' \
  && env -i HOME="$HOME" PATH="$fresh/bin:/usr/bin:/bin" kvfabric --version) || status=1
exit $status
