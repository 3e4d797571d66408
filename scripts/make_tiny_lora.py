#!/usr/bin/env python3
"""Make a tiny random LoRA adapter for a local model (the tiny test model): PEFT's files, written directly.

    python scripts/make_tiny_lora.py MODEL_DIR OUT_DIR [--seed 1] [--rank 8] [--force]

No network and no ``peft``: ``adapter_config.json`` names the adapter (``peft_type`` LORA, rank, alpha, the target
modules) and ``adapter_model.safetensors`` holds, per layer and target module, ``lora_A`` (rank x in) and ``lora_B``
(out x rank) under PEFT's names (``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight``), which
vLLM loads like any adapter from the hub. Weights are seeded random values large enough that the adapter visibly
changes the model's output (two adapters of different seeds answer differently; the tests rely on it).

Deterministic (the same arguments give byte-identical files with the same library versions) and idempotent (a
fingerprint of the arguments and the files' sha256 in OUT_DIR: when it matches, nothing is done).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

SCRIPT_VERSION = 1
FINGERPRINT = "p2pnode_lora.json"
TARGETS = ("q_proj", "v_proj")
#: Scale of the random A and B entries: with alpha / rank = 2 the adapter's delta is of the order of the weights.
WEIGHT_SCALE = 0.5


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shapes(config: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    dims = {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}
    return int(config["num_hidden_layers"]), dims


def build(model_dir: Path, out: Path, seed: int, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    layers, dims = _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in TARGETS:
            fan_in, fan_out = dims[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * WEIGHT_SCALE).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * WEIGHT_SCALE).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir.name,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        print(f"make_tiny_lora: {args.model_dir} has no config.json (build the model first)", file=sys.stderr)
        return 2
    want = {"version": SCRIPT_VERSION, "seed": args.seed, "rank": args.rank,
            "model_config": _sha256(args.model_dir / "config.json")}
    stamp = args.out_dir / FINGERPRINT
    if stamp.is_file() and not args.force:
        have = json.loads(stamp.read_text())
        files = have.get("files", {})
        if {k: have.get(k) for k in want} == want and files and all(
            (args.out_dir / name).is_file() and _sha256(args.out_dir / name) == digest for name, digest in files.items()
        ):
            print(f"make_tiny_lora: {args.out_dir} is up to date")
            return 0
    build(args.model_dir, args.out_dir, args.seed, args.rank)
    files = {p.name: _sha256(p) for p in sorted(args.out_dir.iterdir()) if p.name != FINGERPRINT}
    stamp.write_text(json.dumps({**want, "files": files}, indent=2, sort_keys=True) + "\n")
    print(f"make_tiny_lora: wrote {args.out_dir} (rank {args.rank}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
