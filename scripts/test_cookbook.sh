#!/usr/bin/env bash
# Runs tests/cookbook: tinker-cookbook 0.6.1's library loops (supervised.train, rl.train sync and async,
# preference.train_dpo, distillation.train_on_policy), unmodified, against the server with the tiny model.
#   scripts/test_cookbook.sh [pytest args...]
# The tests run in a venv of their own: tinker-cookbook installed --no-deps plus its declared requirements, all
# pinned (its tml-renderers>=0.4.1 is not published; nothing the loops import needs it), torch pinned exactly to
# the CPU build (any looser requirement pulls a multi-GB CUDA build). The server and the tiny model it serves run
# from the project's venv ($TWINKLE_SERVER_PYTHON, default .venv/bin/python).
# Where: $TWINKLE_COOKBOOK_VENV, default ~/.cache/twinkle-server/venv-cookbook, kept between runs (about 1.5 GB on
# disk, torch most of it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TWINKLE_COOKBOOK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle-server/venv-cookbook}
COOKBOOK=0.6.1

# tinker-cookbook 0.6.1's requirements (METADATA Requires-Dist, less tml-renderers), at the versions tried together
PINS=(
  "torch==2.13.0" "tinker==0.38.0" "transformers==5.24.0" "datasets==5.2.0" "numpy==2.4.6" "pillow==13.0.0"
  "aiohttp==3.14.5" "anyio==4.16.0" "blobfile==3.3.0" "chz==0.4.0" "cloudpickle==3.1.3" "huggingface-hub==2.4.0"
  "pydantic==2.14.4" "pyrage==1.4.0" "rich==15.0.0" "safetensors==0.8.0" "termcolor==3.3.0" "tiktoken==0.14.0"
  "tqdm==4.70.1" "pytest==9.2.0" "pytest-timeout==2.4.0" "httpx==0.29.0"
)
want="tinker-cookbook==$COOKBOOK ${PINS[*]}"

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if [ "$(cat "$VENV/.twinkle-cookbook-deps" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --progress-bar off "${PINS[@]}"
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps "tinker-cookbook==$COOKBOOK"
  echo "$want" >"$VENV/.twinkle-cookbook-deps"
fi
export TWINKLE_SERVER_PYTHON=${TWINKLE_SERVER_PYTHON:-$PWD/.venv/bin/python}
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest tests/cookbook -q -p no:cacheprovider "$@"
