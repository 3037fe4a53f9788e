#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the gpu extra and run exactly the GPU tests
# (FlashInfer against the PyTorch reference backend). Needs a CUDA build of torch already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[dev,gpu]"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"
python3 -m pytest -q -m gpu tests/test_attention_gpu.py "$@"
