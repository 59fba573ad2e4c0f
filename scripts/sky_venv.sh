#!/usr/bin/env bash
# SkyPilot (`launch --scheduler skypilot`, `jobs` for its runs, the sky-marked tests) in a venv of its own outside
# the clone, built like the engines' (engine_venv.sh): SkyPilot pins its own stack (ray, cloud SDKs, ~520 MB) that
# is not the project's, and the head node needs no torch for it. Pinned: the tests use SkyPilot internals that move
# between releases (docs/launch.md). Keyed by a hash of this file, so a changed pin rebuilds it; locked, so two
# clones building at once build once. Prints its python as the last line.
set -euo pipefail
SKY_VERSION=0.14.1
KEY=$( (cat "$0"; echo "skypilot==$SKY_VERSION") | sha256sum | cut -c1-12)
VENV=${SKY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmcluster/sky-$KEY}
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ ! -f $VENV/.installed ]]; then
    echo "building $VENV (skypilot==$SKY_VERSION; once per machine)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install -q --default-timeout 180 "skypilot==$SKY_VERSION" >&2
    "$VENV/bin/python" -c "import sky; sky.Task" >&2
    touch "$VENV/.installed"
fi
echo "$VENV/bin/python"
