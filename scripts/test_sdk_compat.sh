#!/usr/bin/env bash
# Runs tests/compat: an older tinker SDK (0.16.1, the one twinkle-kit 0.5.1 pins), unmodified, against the server.
#   scripts/test_sdk_compat.sh [pytest args...]
# The tests run in a venv of their own holding that SDK, pytest and twinkle-kit's client without its dependencies (no
# torch: neither needs it); the server and the tiny model it serves run from the project's venv
# ($TWINKLE_SERVER_PYTHON, default .venv/bin/python).
# Where: $TWINKLE_SDK016_VENV, default ~/.cache/twinkle-server/venv-tinker016, kept between runs (about 60 MB of
# downloads the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TWINKLE_SDK016_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle-server/venv-tinker016}
SDK=0.16.1 TWINKLE_KIT=0.5.1

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# twinkle-kit without its dependencies (torch, ray, modelscope, ...): only its client's patch of the SDK is used
want="tinker==$SDK twinkle-kit==$TWINKLE_KIT"
if [ "$(cat "$VENV/.twinkle-deps" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --progress-bar off "tinker==$SDK" numpy requests pytest pytest-timeout
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps "twinkle-kit==$TWINKLE_KIT"
  echo "$want" >"$VENV/.twinkle-deps"
fi
export TWINKLE_SERVER_PYTHON=${TWINKLE_SERVER_PYTHON:-$PWD/.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest tests/compat -q -p no:cacheprovider "$@"
