"""Cache namespaces: blocks stored under an adapter or a cache salt answer only lookups in the same namespace, and
the default namespace hashes exactly as before."""

from __future__ import annotations

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockStored
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex

BS = 4
PROMPT = list(range(10, 27))  # 4 full blocks and one token


def _stored(namespace: CacheNamespace, first_engine_hash: int) -> BlockStored:
    engine = tuple(range(first_engine_hash, first_engine_hash + 4))
    return BlockStored(engine, None, tuple(PROMPT[:16]), BS, namespace)


def test_the_default_namespace_hashes_as_before() -> None:
    assert DEFAULT_NAMESPACE.root is None
    assert block_hashes(PROMPT, BS, DEFAULT_NAMESPACE.root) == block_hashes(PROMPT, BS)


def test_namespaces_have_distinct_roots() -> None:
    roots = {CacheNamespace(a, s).root for a in ("", "a", "b") for s in ("", "t1", "t2")}
    assert len(roots) == 9  # the default's None among them


def test_blocks_answer_only_lookups_in_their_namespace() -> None:
    index = PrefixIndex(BS)
    adapter_a, tenant = CacheNamespace("a"), CacheNamespace("", "tenant")
    index.apply(_stored(adapter_a, 100))
    assert index.match(PROMPT, adapter_a) == 16
    assert index.match(PROMPT) == 0
    assert index.match(PROMPT, CacheNamespace("b")) == 0
    assert index.match(PROMPT, CacheNamespace("a", "tenant")) == 0
    index.apply(_stored(tenant, 200))
    assert index.match(PROMPT, tenant) == 16 and index.match(PROMPT) == 0
    index.apply(_stored(DEFAULT_NAMESPACE, 300))
    assert index.match(PROMPT) == 16
    assert len(index) == 12  # three namespaces, four blocks each: the same tokens, three different prefixes
    stats = index.stats()
    assert stats.mismatched_blocks == 0 and stats.orphaned_blocks == 0


def test_a_chain_continues_in_its_parents_namespace() -> None:
    index = PrefixIndex(BS)
    adapter = CacheNamespace("a")
    index.apply(BlockStored((1, 2), None, tuple(PROMPT[:8]), BS, adapter))
    index.apply(BlockStored((3,), 2, tuple(PROMPT[8:12]), BS))  # a continuation names no namespace of its own
    assert index.match(PROMPT, adapter) == 12
    assert index.match(PROMPT) == 0
