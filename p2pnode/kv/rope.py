"""Moving cached keys to another position: RoPE re-rotation.

A Llama-family model rotates each key by its position before it is cached (``k_p = R(p) k``), so a segment's cached
keys carry the position they were computed at. RoPE rotations compose -- ``R(p1 - p0) R(p0) k = R(p1) k`` -- so
keys cached at ``p0`` serve at ``p1`` once rotated by the difference; values carry no position and move unchanged.
That holds whenever the angle is linear in the position (``default``, ``llama3`` and ``linear`` scaling: only the
frequencies change); it does not for YaRN (its cache folds in a magnitude factor) or dynamic NTK (frequencies depend
on the sequence length), which ``Rerotation.for_model`` refuses.

The cos/sin table is vLLM's own (``get_rope`` with the model's ``rope_parameters``), computed in fp32; a key is
rotated in fp32 and cast back to the cache dtype once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["COMPOSABLE_ROPE_TYPES", "Rerotation"]

#: RoPE variants whose rotations compose by position difference.
COMPOSABLE_ROPE_TYPES = ("default", "llama3", "linear")
#: Architectures whose attention applies neox-style RoPE to every key head, before the cache write.
NEOX_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class Rerotation:
    """Rotates cached keys by a position difference."""

    head_size: int
    rotary_dim: int
    cos_sin: Any  # [max_position, rotary_dim]: cos then sin, fp32
    is_neox: bool = True

    @classmethod
    def for_model(cls, vllm_config: Any) -> Rerotation:
        """The model's re-rotation; ``ValueError`` naming why when its RoPE does not compose."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        model = vllm_config.model_config
        hf = model.hf_text_config
        archs = tuple(getattr(model.hf_config, "architectures", None) or ())
        if not set(archs) & set(NEOX_ARCHITECTURES):
            raise ValueError(f"segment re-rotation supports {', '.join(NEOX_ARCHITECTURES)}, not {archs}")
        rope = dict(getattr(hf, "rope_parameters", None) or {"rope_type": "default"})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in COMPOSABLE_ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} does not compose by position difference")
        head_size = model.get_head_size()
        rotary_dim = int(head_size * float(rope.get("partial_rotary_factor", 1.0)))
        with set_current_vllm_config(vllm_config):
            emb = get_rope(
                head_size, model.max_model_len, is_neox_style=True, rope_parameters=rope, dtype=torch.float32
            )
        return cls(head_size, rotary_dim, emb.cos_sin_cache.float(), True)

    def shift(self, keys: Any, delta: int) -> Any:
        """``keys`` (``[tokens, heads, head_size]``) rotated ``delta`` positions further."""
        if delta == 0:
            return keys
        import torch
        from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

        if abs(delta) >= self.cos_sin.shape[0]:
            raise ValueError(f"position shift {delta} beyond the model's {self.cos_sin.shape[0]} positions")
        cos, sin = self.cos_sin[abs(delta)].chunk(2, dim=-1)
        if delta < 0:
            sin = -sin  # R(-d) = R(d)^T
        x = keys.float()
        tokens = x.shape[0]
        rot = ApplyRotaryEmb.forward_static(
            x[..., : self.rotary_dim], cos.expand(tokens, -1), sin.expand(tokens, -1), self.is_neox
        )
        return torch.cat((rot, x[..., self.rotary_dim :]), dim=-1).to(keys.dtype)
