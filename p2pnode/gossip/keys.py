"""The keys the gossip core itself writes and reads in a node's map; every other key belongs to a consumer.

======================  ==============================================  ======================================
key                     value                                           written
======================  ==============================================  ======================================
``addr``                advertised gossip address, UTF-8                at start
``status``              ``b"left"``                                     by ``stop(leave=True)`` or ``withdraw``
``down``                the members this node's own detector declared   on each such death; entries kept
                        dead lately, with their lives                   ``dead_verdict_rounds`` rounds
                        (``verdicts.py``)
======================  ==============================================  ======================================

Consumers publish their own keys through ``GossipAgent.publish`` (docs/gossip.md lists them all: the load, the cache
summary, the rate plan's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pnode.gossip.delta import NodeDelta
    from p2pnode.gossip.state import NodeState

__all__ = [
    "ADDRESS_KEY",
    "CORE_KEYS",
    "DOWN_KEY",
    "LEFT_STATUS",
    "MAX_KEY_CHARS",
    "STATUS_KEY",
    "address_of",
    "delta_address",
]

ADDRESS_KEY = "addr"
STATUS_KEY = "status"
LEFT_STATUS = b"left"
DOWN_KEY = "down"
#: Keys only the core writes: ``GossipAgent.publish`` refuses them.
CORE_KEYS = frozenset({ADDRESS_KEY, STATUS_KEY, DOWN_KEY})
#: Longest key a consumer may publish (every key travels in every delta that carries it).
MAX_KEY_CHARS = 256


def address_of(node: NodeState) -> str | None:
    """The advertised address of ``node`` (its "addr" key), if known."""
    value = node.get(ADDRESS_KEY)
    return value.decode(errors="replace") if value else None


def delta_address(delta: NodeDelta) -> str | None:
    """The address a node delta advertises (its "addr" entry), if it carries one."""
    value = next((v for k, _, v in delta.entries if k == ADDRESS_KEY and v), None)
    return value.decode(errors="replace") if value else None
