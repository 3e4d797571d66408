"""The keys the gossip core itself writes and reads in a node's map; every other key belongs to a consumer.

======================  ==============================================  ======================================
key                     value                                           written
======================  ==============================================  ======================================
``addr``                advertised gossip address, UTF-8                at start
``status``              ``b"left"``                                     by ``stop(leave=True)`` or ``withdraw``
======================  ==============================================  ======================================

Consumers publish their own keys through ``GossipAgent.publish`` (docs/gossip.md lists them all: the load, the cache
summary, the rate plan's).
"""

from __future__ import annotations

__all__ = ["ADDRESS_KEY", "CORE_KEYS", "LEFT_STATUS", "MAX_KEY_CHARS", "STATUS_KEY"]

ADDRESS_KEY = "addr"
STATUS_KEY = "status"
LEFT_STATUS = b"left"
#: Keys only the core writes: ``GossipAgent.publish`` refuses them.
CORE_KEYS = frozenset({ADDRESS_KEY, STATUS_KEY})
#: Longest key a consumer may publish (every key travels in every delta that carries it).
MAX_KEY_CHARS = 256
