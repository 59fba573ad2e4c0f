#!/usr/bin/env bash
# SkyPilot in its own venv (no torch): prints its python as the last line (see engine_venv.sh).
exec bash "$(dirname "$0")/engine_venv.sh" sky "$@"
