#!/usr/bin/env bash
# Prints the CMAKE_ARGS that build llama.cpp (llama-cpp-python) for this CPU, read from
# /proc/cpuinfo (or the file given as $1, for tests): each x86 extension llama.cpp can use is
# switched on only where the CPU reports it, so an AVX2-only EPYC gets an AVX2 build (an AVX-512
# build dies there with SIGILL at the first kernel). GGML_NATIVE stays off because -march=native
# would also turn AMX on, and GCC builds of llama.cpp's AMX path die with SIGILL at the first tile
# instruction: AMX stays off on every machine. LLAVA_BUILD=OFF: llama-cpp-python's multimodal
# library (mtmd, clip, miniaudio), which the peer never loads (llama_cpp imports it only for
# multimodal chat handlers), is a large share of the build's minutes in CI.
set -euo pipefail
CPUINFO=${1:-/proc/cpuinfo}
FLAGS=" $(grep -m1 '^flags' "$CPUINFO" | cut -d: -f2) "
has() { [[ "$FLAGS" == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }

args="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args+=" -DGGML_SSE42=$(onoff sse4_2) -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)"
args+=" -DGGML_F16C=$(onoff f16c) -DGGML_BMI2=$(onoff bmi2) -DGGML_AVX_VNNI=$(onoff avx_vnni)"
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: all or nothing
if has avx512f && has avx512cd && has avx512bw && has avx512dq && has avx512vl; then
  args+=" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)"
  args+=" -DGGML_AVX512_VBMI=$(onoff avx512vbmi)"
else
  args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF"
fi
echo "$args"
