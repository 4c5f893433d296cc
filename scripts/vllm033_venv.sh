#!/usr/bin/env bash
# Builds the vLLM 0.33 test venv (default .venv-vllm033) that `scripts/dev.sh test` runs
# tests/vllm033 in: the unmodified official vllm 0.33.0 wheel, installed WITHOUT its
# dependencies over the CPU build of torch 2.13 (this machine's disk), plus 0.33's other
# requirements except torch and its CUDA-only packages (docs/VLLM_COMPAT.md says why).
# Nothing compiled from vLLM is loaded by those tests: they use vLLM's pure-Python layout
# resolution, KV cache planner, allocator, Scheduler and connector factory.
#
#   scripts/vllm033_venv.sh [VENV]     # re-installs only when this script or pyproject.toml changed
#
# Exits non-zero when the venv cannot be built (the test run then fails; it never skips).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm033}
PY=${PYTHON:-python3}
VLLM_VERSION=0.33.0
# Requirements of the 0.33 wheel that are torch itself or need CUDA (a GPU build of torch,
# CUDA libraries, GPU kernels): left out, torch is held at the local CPU build instead.
CUDA_ONLY='^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels)$'

stamp="$VENV/.kvt-vllm033-installed"
want=$(cat pyproject.toml scripts/vllm033_venv.sh | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "[vllm033_venv] installing vllm $VLLM_VERSION (no deps) over CPU torch 2.13 into $VENV ..." >&2
start=$(date +%s)
rm -f "$stamp"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip setuptools wheel
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${pip[@]}" download -q --no-deps -d "$work" "vllm==$VLLM_VERSION"
whl=$(ls "$work"/vllm-"$VLLM_VERSION"-*.whl)
# The wheel's own Requires-Dist (no extras), minus torch and the CUDA-only packages.
"$VENV/bin/python" - "$whl" "$CUDA_ONLY" > "$work/reqs.txt" <<'EOF'
import re, sys, zipfile
whl, cuda_only = sys.argv[1], re.compile(sys.argv[2], re.I)
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    if not cuda_only.match(name):
        print(req)
EOF
echo "torch==2.13.0" > "$work/constraints.txt"
"${pip[@]}" install -q torch==2.13.0
"${pip[@]}" install -q -c "$work/constraints.txt" -r "$work/reqs.txt"
"${pip[@]}" install -q --no-deps "$whl"
"${pip[@]}" install -q -c "$work/constraints.txt" -e ".[dev]"
# The check that the venv is what it claims: vLLM 0.33 imports on the CPU torch.
"$VENV/bin/python" -c "import torch, vllm; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__; \
assert not torch.version.cuda, torch.version.cuda"
echo "$want" > "$stamp"
echo "[vllm033_venv] installed in $(( $(date +%s) - start )) s" >&2
