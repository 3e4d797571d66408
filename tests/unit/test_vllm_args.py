"""`serve` passes vLLM engine arguments it has no flag for (`--engine-arg KEY=VALUE`), read by vLLM's own
parser, and `--gpu-memory-utilization`; on CPU, without a memory setting, the KV cache has a size that starts on a
shared host instead of vLLM's 92% of NUMA node 0. Before, `serve` accepted neither flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode import cli
from p2pnode.cli import serve
from p2pnode.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from p2pnode.engine.vllm_args import EngineArgError, parse_engine_args
from p2pnode.engine.vllm_engine import VllmEngine


def test_engine_args_are_read_by_vllms_own_parser() -> None:
    parsed = dict(parse_engine_args([
        "max-num-batched-tokens=4096", "enable_chunked_prefill=false", "kv_cache_dtype=auto", "max_logprobs=5",
    ]))
    assert parsed == {
        "max_num_batched_tokens": 4096, "enable_chunked_prefill": False, "kv_cache_dtype": "auto", "max_logprobs": 5,
    }
    assert parse_engine_args(["max_logprobs=5", "max_logprobs=7"]) == (("max_logprobs", 7),)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("block_size=64", "use --block-size"),
        ("enable_prefix_caching=false", "p2pnode sets it"),
        ("kv_events_config={}", "p2pnode sets it"),
        # before: accepted, and a node with a KV connector then failed to start (the argument given twice)
        ("scheduling_policy=fcfs", "p2pnode sets it"),
        # vLLM's own offloading and connector settings would silently replace p2pnode's connectors
        ("kv_offloading_size=4", "use --host-kv-bytes"),
        ("kv_offloading_backend=native", "use --host-kv-bytes"),
        ('kv_transfer_config={"kv_connector":"ExampleConnector","kv_role":"kv_both"}', "use --host-kv-bytes"),
        # before: passed (the LoRA fields are p2pnode's flags but were not reserved): enable_lora=true turned LoRA on
        # in vLLM while p2pnode refused every adapter; max_lora_rank with --enable-lora failed the engine's start
        ("enable_lora=true", "use --enable-lora"),
        ("max_lora_rank=16", "use --max-lora-rank"),
        ("no_such_argument=1", "not an engine argument"),
        ("max_num_batched_tokens=lots", "max-num-batched-tokens"),
        ("kv_cache_dtype=int3", "invalid choice"),
        ("enable_chunked_prefill=maybe", "true or false"),
        ("max_num_batched_tokens", "KEY=VALUE"),
    ],
)
def test_a_wrong_engine_arg_is_refused_naming_it(item: str, message: str) -> None:
    with pytest.raises(EngineArgError, match=message) as info:
        parse_engine_args([item])
    assert str(info.value).startswith("--engine-arg")


def test_serve_flags_reach_the_engine_arguments(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args([
        "serve", "--model", str(tmp_path), "--node-id", "n", "--gpu-memory-utilization", "0.5",
        "--engine-arg", "max_num_batched_tokens=2048",
    ])
    assert args.gpu_memory_utilization == 0.5
    assert serve.engine_args(args) == (("max_num_batched_tokens", 2048),)
    config = EngineConfig(model=tmp_path, gpu_memory_utilization=0.5, engine_args=serve.engine_args(args))
    built = VllmEngine(config)._engine_args("ipc:///tmp/e", "ipc:///tmp/r")
    assert (built.gpu_memory_utilization, built.max_num_batched_tokens) == (0.5, 2048)
    assert built.kv_cache_memory_bytes is None  # the utilization sizes the cache
    assert built.enable_prefix_caching and built.kv_events_config.enable_kv_cache_events


def test_on_cpu_the_default_kv_cache_is_sized_to_start_on_a_shared_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    built = VllmEngine(EngineConfig(model=tmp_path))._engine_args("ipc:///tmp/e", "ipc:///tmp/r")
    assert built.kv_cache_memory_bytes == DEFAULT_CPU_KV_CACHE_BYTES  # this suite runs on vLLM's CPU build
    explicit = VllmEngine(EngineConfig(model=tmp_path, kv_cache_bytes=1 << 24))._engine_args("a", "b")
    assert explicit.kv_cache_memory_bytes == 1 << 24
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own setting wins when the operator gives it
    assert VllmEngine(EngineConfig(model=tmp_path))._engine_args("a", "b").kv_cache_memory_bytes is None
