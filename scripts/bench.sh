#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: `tetris-hf stream-bench` on the offline default pair
# (SmolLM2-135M-Instruct + the shipped 2-layer draft), 24 requests of the mixed set (ShareGPT first turns, code edits
# and summaries, interleaved), hybrid drafting (the draft model, and prompt lookup wherever a row's output copies its
# prompt), at most 8 rows at once, up to 64 new tokens: the request stream (TETRIS, adaptive) beside transformers'
# generate_batch, static generate() and static TETRIS in chunks of 8.
# Extra arguments go to `tetris-hf stream-bench` (e.g. --repeats 3, --strategies tetris,fixed,adaptive).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
tetris-hf stream-bench --prompts mixed --hybrid --num-prompts 24 --max-batch-size 8 --max-new-tokens 64 \
  --strategies tetris,adaptive --output bench-out "$@"
