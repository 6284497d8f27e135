#!/usr/bin/env bash
# The optional llama.cpp peer (benchmarks/llama_cpp_peer.py, serving.py --llama-cpp): the `peers`
# extra's packages into .venv. llama-cpp-python builds llama.cpp from source (~10 min on 2 cores).
# With GCC its AMX path dies with SIGILL at the first tile instruction, so AMX stays off and the
# AVX-512/VNNI paths are chosen explicitly (GGML_NATIVE would turn AMX on).
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# the versions of pyproject.toml's `peers` extra
.venv/bin/pip install -q gguf==0.19.0 llama-cpp-python==0.3.36
.venv/bin/python -c "import gguf, llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
