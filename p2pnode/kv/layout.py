"""A node's KV layout fingerprint: two engines may exchange raw KV blocks only when theirs are equal.

A block's bytes mean the same thing on two nodes only when they run the same weights (not just the same
architecture: another fine-tune's KV is other numbers), the same KV dtype and block size, the same vLLM (its block
format), and -- on CPU -- the same attention kernel layout: vLLM's CPU backend packs each block for the host's ISA
(``amx``, ``vec``, ``neon``...), so an AMX node's blocks are noise to an AVX2 one. The fingerprint names all of them,
short enough to travel in every cache summary (``cache/summary.SummaryMeta.kv_layout``).

The weights are identified by a hash of ``config.json`` and, for each weight file, its size and first MiB (which
holds the safetensors header: every tensor's name, shape and offset), so two copies of a model agree wherever they
live while two fine-tunes do not; reading it costs milliseconds however large the model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["kv_layout", "weights_fingerprint"]

#: Bytes read from the start of each weight file for the fingerprint.
WEIGHT_HEAD_BYTES = 1 << 20
#: Hex digits of the weights' hash kept in the fingerprint.
WEIGHT_HASH_DIGITS = 12


def weights_fingerprint(model_dir: Path) -> str:
    """A short hash of the model's config and weight files (module docstring)."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        digest.update(path.name.encode())
        digest.update(str(path.stat().st_size).encode())
        with path.open("rb") as f:
            digest.update(f.read(WEIGHT_HEAD_BYTES))
    return digest.hexdigest()[:WEIGHT_HASH_DIGITS]


def _model_shape(model_dir: Path) -> tuple[int, int, int, str]:
    """(layers, KV heads, head size, torch dtype name) from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    dtype = next((c[k] for c in (text, config) for k in ("dtype", "torch_dtype") if c.get(k)), "float32")
    return layers, kv_heads, head_dim, str(dtype)


def kv_layout(model_dir: Path, dtype: str, block_size: int) -> str:
    """This host's fingerprint for ``model_dir`` served with ``dtype`` ("auto": the model's) and ``block_size``."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    layers, kv_heads, head_dim, model_dtype = _model_shape(model_dir)
    name = model_dtype if dtype == "auto" else dtype
    torch_dtype = getattr(torch, {"half": "float16", "float": "float32"}.get(name, name))
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        kernel = f"cpu-{_get_attn_isa(torch_dtype, block_size, head_dim)}"
    else:
        kernel = current_platform.device_name
    dtype_name = str(torch_dtype).removeprefix("torch.")
    return (
        f"{weights_fingerprint(model_dir)}/{dtype_name}/b{block_size}/{layers}x{kv_heads}x{head_dim}/"
        f"vllm-{vllm.__version__}/{kernel}"
    )
