"""The hot segment keys a node gossips: which reusable segments (retrieved documents, tool outputs) its engine's
segment store holds, so that any ingress can send a request where its segments are (``routing/segments.py``).

A segment key (``cache/segments.segment_key``) names a segment's tokens wherever they sit in a prompt, so a set of
keys is all a peer needs: the request itself knows each segment's length. Like the block summary
(``cache/summary.py``), each published key is one gossip key, ``"s/" + base64url(8-byte key)`` with an empty value
(~16 B on the wire), so a change costs exactly the keys that changed and a dropped segment becomes a tombstone.

Bounded: at most ``max_bytes // SEGMENT_ENTRY_BYTES`` keys (``config.DEFAULT_SEGMENT_SUMMARY_BYTES``: 64 KiB, 4,096
keys), the newest the store took first when they do not all fit (under LRU what it took last is what it holds
longest; the default holds every key of a store of ~1M tokens of 255-token passages, so the order seldom matters).
Polled once per gossip round (``attach``), never from the engine's path; a node whose engine keeps no store (the
simulated engine, an engine with ``--segment-store-mb 0``) publishes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from p2pnode.cache.summary import Publisher, hash_key, key_hash

__all__ = ["SEGMENT_ENTRY_BYTES", "SEGMENT_PREFIX", "SegmentPublisher", "hot_keys", "key_segment", "segment_state_key"]

#: Prefix of the segment keys in a node's gossip state.
SEGMENT_PREFIX = "s/"
#: Wire bytes of one published key: the 13-character key, its version step and an empty value.
SEGMENT_ENTRY_BYTES = 16


def segment_state_key(key: int) -> str:
    """The gossip key publishing segment ``key``."""
    return hash_key(key, SEGMENT_PREFIX)


def key_segment(name: str) -> int | None:
    """The segment key a gossip key publishes; None when ``name`` is not a well-formed segment key."""
    return key_hash(name, SEGMENT_PREFIX)


def hot_keys(held: Sequence[int], max_bytes: int) -> list[int]:
    """The keys to publish of ``held`` (a store's keys, oldest first): the newest that fit ``max_bytes``."""
    count = max_bytes // SEGMENT_ENTRY_BYTES
    return list(held[-count:]) if count > 0 else []


class SegmentPublisher:
    """Keeps the published segment keys in step with what the engine's store holds (module docstring).

    ``holdings()``: the keys the store holds (-> their tokens), oldest first (``VllmEngine.segment_holdings``)."""

    def __init__(self, holdings: Callable[[], Mapping[int, int]], max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.holdings = holdings
        self.max_bytes = max_bytes
        self.published: set[int] = set()

    def poll(self) -> tuple[list[int], list[int]]:
        """What to publish and what to withdraw now (both empty when nothing changed)."""
        target = set(hot_keys(list(self.holdings()), self.max_bytes))
        added = [k for k in target if k not in self.published]
        removed = [k for k in self.published if k not in target]
        self.published = target
        return added, removed

    def attach(self, agent: Publisher) -> None:
        """Publish through ``agent``: polled at the start of each of its rounds."""

        def publish_changes() -> None:
            added, removed = self.poll()
            for key in removed:
                agent.unpublish(segment_state_key(key))
            for key in added:
                agent.publish(segment_state_key(key), b"")

        agent.before_round(publish_changes)
