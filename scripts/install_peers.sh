#!/usr/bin/env bash
# The optional llama.cpp peer (benchmarks/llama_cpp_peer.py; serving.py --llama-cpp runs it in
# process and as llama-cpp-python's OpenAI server): the `peers` extra's packages into .venv.
# llama-cpp-python builds llama.cpp from source (~7 min on 2 cores), for the CPU it runs on (scripts/llama_cpp_cmake_args.sh says which extensions and why AMX is
# off). CMAKE_ARGS in the environment replaces that choice.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${CMAKE_ARGS:-$(bash scripts/llama_cpp_cmake_args.sh)}"
echo "llama.cpp build: $CMAKE_ARGS"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# the versions of pyproject.toml's `peers` extra; --no-cache-dir: never reuse a wheel that pip
# cached after building it for another machine's CPU
.venv/bin/pip install -q --no-cache-dir gguf==0.19.0 "llama-cpp-python[server]==0.3.36"
.venv/bin/python -c "import gguf, llama_cpp, llama_cpp.server.app; print('llama-cpp-python', llama_cpp.__version__, '(with its server)')"
