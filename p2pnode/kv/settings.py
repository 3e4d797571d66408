"""What a node tells its engine's KV connector, in one type both sides share.

The node writes it into vLLM's ``kv_connector_extra_config`` (``to_extra``); vLLM hands that dict to
``PeerPullConnector`` in its scheduler and worker processes, which read it back (``from_extra``). Every field is
written by the node and none has a default here, so the connector never runs on a value of its own: a setting the
node did not send fails the engine's start instead of silently meaning something else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnode.config import KvSetup

__all__ = ["ConnectorSettings"]


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings (``kv/connector.py``), from the node's ``KvSetup``."""

    #: The engine's KV layout fingerprint ("": it lends and pulls no blocks).
    kv_layout: str
    #: Where its block server listens ("": none) and writes the port it took.
    kv_host: str
    kv_port_file: str
    #: Pulls its block server streams at once; longest a pull's transfer may take; fault injection per block sent.
    max_streams: int
    fetch_timeout_s: float
    block_delay_s: float
    #: The segment store of approximate reuse (0 bytes: none), its eviction policy, and whether loaded segments'
    #: keys are re-rotated to their new positions.
    segment_store_bytes: int
    segment_policy: str
    segment_rotation: bool

    @classmethod
    def of(cls, kv: KvSetup, layout: str, port_file: Path, store_bytes: int) -> ConnectorSettings:
        """The settings for an engine whose layout is ``layout`` ("" unless it pulls) and whose platform keeps a
        segment store of ``store_bytes``."""
        pulls = kv.pulls
        return cls(
            kv_layout=layout,
            kv_host=kv.block_server_host,
            kv_port_file=str(port_file),
            max_streams=pulls.max_streams if pulls else 0,
            fetch_timeout_s=pulls.fetch_timeout_s if pulls else 0.0,
            block_delay_s=pulls.block_delay_s if pulls else 0.0,
            segment_store_bytes=store_bytes,
            segment_policy=kv.segments.policy,
            segment_rotation=kv.segments.rotate,
        )

    def to_extra(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """Read back what ``to_extra`` wrote (KeyError names a setting the node did not send)."""
        return cls(**{f.name: extra[f.name] for f in dataclasses.fields(cls)})
