"""``--engine-arg KEY=VALUE``: the vLLM engine arguments p2pnode has no flag of its own for.

Each is read exactly as ``vllm serve --KEY VALUE`` would read it: the value goes through vLLM's own argument parser
(``AsyncEngineArgs.add_cli_args``), so types, choices and JSON configs follow vLLM 0.32, and a mistake is refused
before the engine starts, naming the argument. Names are vLLM's, with dashes or underscores. The arguments p2pnode
sets itself (``RESERVED_ENGINE_ARGS``: its own flags, prefix caching and KV events, which the mesh routes on) are
refused with the flag to use instead.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

from p2pnode.config import RESERVED_ENGINE_ARGS

#: The p2pnode flag that sets a reserved argument ("" when p2pnode always sets it itself).
_OWN_FLAGS = {
    "model": "--model",
    "block_size": "--block-size",
    "max_model_len": "--max-model-len",
    "kv_cache_memory_bytes": "--kv-cache-bytes",
    "dtype": "--dtype",
    "enforce_eager": "--enforce-eager",
    "tensor_parallel_size": "--tensor-parallel-size",
    "max_num_seqs": "--max-num-seqs",
    "seed": "--seed",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enable_lora": "--enable-lora",
    "lora_modules": "--lora-modules",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "",
    "served_model_name": "--served-model-name",
    # p2pnode's connectors (KV pulls, segments, the host tier) are the engine's KV transfer config: vLLM's would
    # silently replace them
    "kv_offloading_size": "--host-kv-bytes",
    "kv_offloading_backend": "--host-kv-bytes",
    "kv_transfer_config": "--host-kv-bytes",
}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class EngineArgError(ValueError):
    """An ``--engine-arg`` that vLLM would not take (the message names it)."""


class _Refusal(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refusal(message)


@functools.cache
def _vllm_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    """vLLM's own ``vllm serve`` engine-argument parser (imports vLLM: seconds) and its actions by field name."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(_Parser, FlexibleArgumentParser):
        pass

    parser = AsyncEngineArgs.add_cli_args(Parser(add_help=False))
    return parser, {a.dest: a for a in parser._actions if a.option_strings}


def _flag_value(name: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise EngineArgError(f"--engine-arg {name}: expects true or false, got {text!r}")


def _named(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` as (field name, value text); a malformed item or a reserved name refused."""
    key, sep, text = item.partition("=")
    name = key.strip().lstrip("-").replace("-", "_")
    if not sep or not name:
        raise EngineArgError(f"--engine-arg {item!r}: expected KEY=VALUE (e.g. max_num_batched_tokens=8192)")
    if name in RESERVED_ENGINE_ARGS or name in _OWN_FLAGS:  # a field p2pnode's own flag sets (LoRA's among them)
        flag = _OWN_FLAGS.get(name)
        use = f"use {flag}" if flag else "p2pnode sets it (the mesh depends on it)"
        if flag == "--host-kv-bytes":  # vLLM's KV connector settings: why a host tier is a flag of p2pnode's
            use += " (p2pnode runs its own KV connectors in the engine, the host tier among them)"
        raise EngineArgError(f"--engine-arg {name}: {use}")
    return name, text


def parse_engine_args(items: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """``KEY=VALUE`` items as ``(AsyncEngineArgs field, value)`` pairs (the last of a repeated key wins)."""
    if not items:
        return ()
    named = [_named(item) for item in items]  # checked before vLLM's parser is imported (seconds)
    parser, actions = _vllm_parser()
    out: dict[str, Any] = {}
    for name, text in named:
        action = actions.get(name)
        if action is None:
            raise EngineArgError(
                f"--engine-arg {name}: not an engine argument of vLLM (`vllm serve --help` lists them)"
            )
        if action.nargs == 0:  # a switch (--enable-x / --no-enable-x, or --x)
            out[name] = _flag_value(name, text)
            continue
        try:
            namespace = parser.parse_args([action.option_strings[0], text])
        except _Refusal as e:
            raise EngineArgError(f"--engine-arg {name}: {e}") from None
        except (ValueError, TypeError) as e:
            raise EngineArgError(f"--engine-arg {name}: {str(e).splitlines()[0]}") from None
        out[name] = getattr(namespace, action.dest)
    return tuple(out.items())
