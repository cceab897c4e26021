#!/usr/bin/env bash
# Builds libkvfabric_ffi (release) and installs the shared and static libraries, the header
# and a pkg-config file under PREFIX (default /usr/local):
#   scripts/install-ffi.sh [PREFIX]
#   gcc app.c $(PKG_CONFIG_PATH=PREFIX/lib/pkgconfig pkg-config --cflags --libs kvfabric)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-/usr/local}"
target="${CARGO_TARGET_DIR:-target}"
cargo build --release -p kvfabric-ffi
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/release/libkvfabric_ffi.so" "$prefix/lib/"
install -m 0644 "$target/release/libkvfabric_ffi.a" "$prefix/lib/"
install -m 0644 ffi/include/kvfabric.h "$prefix/include/"
sed -e "s|@PREFIX@|$prefix|" -e "s|@LIBDIR@|$prefix/lib|" -e "s|@VERSION@|$version|" \
  ffi/kvfabric.pc.in >"$prefix/lib/pkgconfig/kvfabric.pc"
echo "installed libkvfabric_ffi $version under $prefix"
