#!/usr/bin/env bash
# Builds the kvfabric wheel (ffi/python: the Python binding, the connectors, libkvfabric_ffi
# and the kvfabric command) into $DIST (default dist/), ready for `pip install` on a machine
# without a Rust toolchain:
# 1. `pip wheel` with setuptools-rust, which runs cargo for the library and the command
#    (PROFILE: release by default; CI builds dev, reusing its target directory);
# 2. debug information stripped from both (the release profile keeps line tables for
#    backtraces here; a wheel need not carry them);
# 3. tagged py3-none (the library does not use Python's C API, so any Python 3 loads it) and
#    with the platform tag that auditwheel finds the files consistent with: the oldest glibc
#    whose symbol versions they need (manylinux_2_35_x86_64 when built on Debian 12).
#   KVFABRIC_BUILD_VENV  where the build tools live (default ~/.cache/kvfabric/build-venv):
#                        setuptools and setuptools-rust (pyproject.toml's build requirements,
#                        installed once rather than in an isolated environment per build),
#                        wheel and auditwheel
#   CARGO_TARGET_DIR     the cargo target directory (default ./target)
# Prints the wheel's path.
set -euo pipefail
cd "$(dirname "$0")/.."
dist="$(mkdir -p "${DIST:-dist}" && cd "${DIST:-dist}" && pwd)"
venv="${KVFABRIC_BUILD_VENV:-$HOME/.cache/kvfabric/build-venv}"
tools=("setuptools>=77" "setuptools-rust>=1.13" wheel auditwheel)
if ! "$venv/bin/python" -c "import setuptools_rust, wheel, auditwheel" >/dev/null 2>&1; then
  echo "creating $venv (${tools[*]})" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip "${tools[@]}" >&2
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

SETUPTOOLS_RUST_CARGO_PROFILE="${PROFILE:-release}" \
  "$venv/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$tmp/built" ./ffi/python >&2
built="$(ls "$tmp"/built/kvfabric-*.whl)"

"$venv/bin/python" -m wheel unpack -d "$tmp/unpacked" "$built" >&2
root="$(ls -d "$tmp"/unpacked/kvfabric-*)"
strip --strip-debug "$root"/kvfabric/libkvfabric_ffi*.so "$root"/kvfabric-*.data/scripts/kvfabric
mkdir -p "$tmp/packed"
"$venv/bin/python" -m wheel pack -d "$tmp/packed" "$root" >&2
packed="$(ls "$tmp"/packed/kvfabric-*.whl)"

platform="$("$venv/bin/auditwheel" show "$packed" 2>&1 | tr '\n' ' ' \
  | grep -o 'following platform tag: *"[a-z0-9_]*"' | head -1 | grep -o '"[a-z0-9_]*"' | tr -d '"')"
if [ -z "$platform" ]; then
  echo "auditwheel found no platform tag for $packed:" >&2
  "$venv/bin/auditwheel" show "$packed" >&2 || true
  exit 1
fi
"$venv/bin/python" -m wheel tags --remove --python-tag py3 --abi-tag none \
  --platform-tag "$platform" "$packed" >/dev/null
rm -f "$dist"/kvfabric-*.whl
mv "$tmp"/packed/kvfabric-*.whl "$dist/"
ls "$dist"/kvfabric-*.whl
