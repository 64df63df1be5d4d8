#!/usr/bin/env bash
# Runs tests/native: twinkle-kit 0.5.1's own client (twinkle_client), unmodified, against the server's native
# Twinkle routes, with client-side data preparation by twinkle itself (Dataset / Template / SelfCognitionProcessor /
# DataLoader), plus the twinkle-kit README's Tinker example (init_tinker_client + input_feature_to_datum).
#   scripts/test_native.sh [pytest args...]
# The tests run in a venv of their own holding twinkle-kit without its declared dependencies (modelscope, omegaconf,
# pyzmq, typer, accelerate are not imported by what the tests use) plus exactly what its client and client-side data
# path import: torch (CPU), transformers, datasets, peft, pillow, fastapi, tinker 0.16.1 and ray[serve] (imported by
# twinkle.server.common). The server and the tiny model it serves run from the project's venv
# ($TWINKLE_SERVER_PYTHON, default .venv/bin/python).
# Where: $TWINKLE_NATIVE_VENV, default ~/.cache/twinkle-server/venv-twinkle, kept between runs (about 2 GB on disk;
# torch and ray make most of it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TWINKLE_NATIVE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle-server/venv-twinkle}
TWINKLE_KIT=0.5.1

# twinkle-kit needs Python 3.11 or 3.12
if ! "$PY" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 12) else 1)' 2>/dev/null; then
  for cand in python3.11 python3.12 /usr/bin/python3.11 /usr/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi

# Versions tried together (CPU, Python 3.11). The ranges of twinkle-kit's METADATA and its [client] extra are in the
# constraints; torch is pinned exactly: any looser requirement pulls a multi-GB CUDA build.
PINS=(
  "torch==2.13.0" "tinker==0.16.1" "numpy==2.2.6" "peft==0.19.0" "transformers==5.24.0" "datasets==5.2.0"
  "pillow==13.0.0" "fastapi==0.165.0" "ray[serve]==2.60.0" "requests==2.34.2" "pytest==9.2.0" "pytest-timeout==2.4.0"
)
want="twinkle-kit==$TWINKLE_KIT ${PINS[*]}"

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if [ "$(cat "$VENV/.twinkle-native-deps" 2>/dev/null)" != "$want" ]; then
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  printf '%s\n' "torch==2.13.0" "tinker==0.16.1" "peft<=0.19" "numpy<2.3" >"$constraints"
  "$VENV/bin/python" -m pip install -q --progress-bar off -c "$constraints" "${PINS[@]}"
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps "twinkle-kit==$TWINKLE_KIT"
  echo "$want" >"$VENV/.twinkle-native-deps"
fi
export TWINKLE_SERVER_PYTHON=${TWINKLE_SERVER_PYTHON:-$PWD/.venv/bin/python}
export HF_HUB_OFFLINE=1 MODELSCOPE_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest tests/native -q -p no:cacheprovider "$@"
