"""Every key a node publishes in its own map (the namespace, in one place).

======================  ==============================================  ======================================
key                     value                                           written
======================  ==============================================  ======================================
``addr``                advertised gossip address, UTF-8                at start
``status``              ``b"left"``                                     by ``stop(leave=True)``, last write
``load``                msgpack [running, waiting, kv_usage, in_flight]  at most once per round, when changed
``summary``             msgpack [stride, block_size]                    when a PrefixIndex is attached / stride
``h/<base64url hash>``  empty                                           cache summary (``summary.py``)
``rates/top``           the node's top keys by request rate (msgpack)   every plan period (``plan/rates.py``)
``rates/plan``          the rate plan, by the node that built it        by the planner (``plan/sync.py``)
======================  ==============================================  ======================================
"""

from __future__ import annotations

__all__ = [
    "ADDRESS_KEY",
    "LEFT_STATUS",
    "RATES_PREFIX",
    "STATUS_KEY",
    "SUMMARY_META_KEY",
    "SUMMARY_PREFIX",
]

ADDRESS_KEY = "addr"
STATUS_KEY = "status"
LEFT_STATUS = b"left"
SUMMARY_META_KEY = "summary"
SUMMARY_PREFIX = "h/"
RATES_PREFIX = "rates/"
