#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: `tetris-hf bench` on the offline default pair
# (SmolLM2-135M-Instruct + the shipped 2-layer draft), 16 ShareGPT prompts, batch 16, 64 new tokens.
# Extra arguments go to `tetris-hf bench` (e.g. --strategies generate,fixed,tetris,adaptive,dsd).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
tetris-hf bench --prompts sharegpt --num-prompts 16 --batch-size 16 --max-new-tokens 64 --output bench-out "$@"
