#!/usr/bin/env bash
# Sets up a fresh machine and runs the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
