#!/usr/bin/env bash
# vLLM's `speculators` (its EAGLE-3 model, config and converters) in a virtual environment of its own (it
# pins transformers < 5.20; specdec's tests run a newer one), for benchmarks/peers/speculators_oracle.py and
# tests/test_speculators_oracle.py. Usage: bash benchmarks/peers/make_speculators_venv.sh [DIR]
# (default .venv-speculators). torch 2.13.0 first, so pip takes the CPU build on disk instead of a CUDA one.
set -euo pipefail
dir="${1:-.venv-speculators}"
python3 -m venv "$dir"
"$dir/bin/pip" install -q "torch==2.13.0" "speculators==0.9.0"
# their builds from the package index are not for the CPU torch: importing transformers' model classes
# fails in torchvision's operator registration; nothing text-only needs them
"$dir/bin/pip" uninstall -q -y torchvision torchaudio || true
"$dir/bin/python" -c "import importlib.metadata as m, speculators; print('speculators', m.version('speculators'))"
