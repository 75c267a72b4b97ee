#!/usr/bin/env bash
# Times one of the README's commands as a newcomer runs it: a fresh clone of this checkout's HEAD with no caches
# (an empty HOME, so no ~/.cache/tetris_hf or Hugging Face cache; no pip cache; empty inductor and XDG caches). pip
# keeps this machine's own index settings (its pip.conf), as CI's machine has them.
# Usage: bash scripts/fresh-clone-time.sh scripts/bench.sh|scripts/test.sh [ARGS...]   (prints the wall seconds at
# the end; ARGS go to the command, e.g. --durations=20 to pytest)
set -euo pipefail
command="${1:?usage: fresh-clone-time.sh scripts/bench.sh|scripts/test.sh [ARGS...]}"
shift
source_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scratch="$(mktemp -d /tmp/tetris-fresh-XXXXXX)"
git clone --quiet "$source_repo" "$scratch/clone"
mkdir -p "$scratch/home" "$scratch/xdg" "$scratch/inductor"
ln -s "$source_repo/../shared" "$scratch/shared" 2>/dev/null || true   # CI has shared/ beside its clone too
cd "$scratch/clone"
pip_config="${PIP_CONFIG_FILE:-$HOME/.config/pip/pip.conf}"
[ -f "$pip_config" ] && export PIP_CONFIG_FILE="$pip_config"
started=$(date +%s)
set +e
env -u PYTHONPATH HOME="$scratch/home" PIP_NO_CACHE_DIR=1 XDG_CACHE_HOME="$scratch/xdg" \
    TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" bash "$command" "$@"
status=$?
set -e
echo "fresh-clone-time: $command exited $status after $(( $(date +%s) - started )) s wall (clone in $scratch/clone)"
exit $status
