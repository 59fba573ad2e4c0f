#!/usr/bin/env bash
# lm-evaluation-harness in its own venv: prints its python as the last line (see engine_venv.sh).
exec bash "$(dirname "$0")/engine_venv.sh" lmeval "$@"
