#!/usr/bin/env bash
# A second venv with the oldest supported torch (pyproject's `torch>=` floor) from the registry, for
# `make test-compat`. It lives outside the clone, keyed by a hash of pyproject.toml and the floor, so a fresh
# clone on the same machine (CI) reuses it. The registry's default Linux wheel is a CUDA build that runs on a
# CPU (a few GB with its nvidia-* dependencies). pip's machine-wide configuration (local mirrors, a constraints
# file) is set aside for this one install: the floor comes from the registry itself. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[[ -n $FLOOR ]] || { echo "error: no \"torch>=X\" line in pyproject.toml" >&2; exit 2; }
[[ $FLOOR == *.*.* ]] || FLOOR=$FLOOR.0
KEY=$( (cat pyproject.toml; echo "torch==$FLOOR") | sha256sum | cut -c1-12)
VENV=${COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmcluster/compat-torch$FLOOR-$KEY}
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # two clones (CI jobs) building the same venv at once: one builds, the other waits and reuses it
if [[ ! -f $VENV/.installed ]]; then
    echo "building $VENV (torch==$FLOOR from the registry; a few GB, once)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2
    # The project's own dependencies from pyproject (main list + test extra), but not the project itself:
    # the tests run this clone through PYTHONPATH, so the venv does not depend on where the clone lies.
    DEPS=$(python3 - <<'PY'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
# torchao and torchft are left out too: their floors (torch >= 2.11, >= 2.7) are above ours; their tests skip without
deps = [d for d in p["dependencies"] + p["optional-dependencies"]["test"] if not re.match(r"torch(ao|ft)?\b", d)]
print("\n".join(deps))
PY
)
    mapfile -t DEPS <<<"$DEPS"
    PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q --default-timeout 180 \
        "torch==$FLOOR" "${DEPS[@]}" >&2
    "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$FLOOR'), torch.__version__" >&2
    touch "$VENV/.installed"
fi
echo "$VENV/bin/python"
