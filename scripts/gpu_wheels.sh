#!/usr/bin/env bash
# Wheels (CPython 3.12, x86-64) of what the engine imports beyond torch/transformers/numpy/safetensors, for a GPU
# machine that cannot reach a package index: the tinker SDK (its protobuf codec), pydantic, zstandard and their
# needs. Writes them to .whl/ (git-ignored through .git/info/exclude). On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  tinker==0.38.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 zstandard==0.25.0 orjson==3.13.0 distro==1.9.0 h2==4.4.1 hpack==4.2.0 \
  hyperframe==6.1.0 sniffio==1.3.1
ls .whl
