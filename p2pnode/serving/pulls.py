"""A node's side of moving KV between engines: asking a holder for a prefix before serving a request, and lending
this node's cached blocks to a peer about to serve one.

The ingress decides a pull (``routing/policies/p2p.py``: serve at B with the prefix pulled from A) and the serving node
B carries it out, before its engine sees the request:

1. B asks A over the mesh's authenticated channel (``Forwarder/Export``, a signed envelope bound to A): "lease me the
   first ``blocks`` blocks of these tokens"; A checks that B's KV layout is its own, that its exact indexes still hold
   those blocks (in its engine, or right after the engine's part in its host tier), and its caps, then has its engine
   lease them (``engine.export``: one step, ahead of its queue; the engine loads what its host tier holds first) and
   answers with the lease and its engine's block server address;
2. B hands its engine the lease (``PullSource``): the engine's connector pulls the blocks worker to worker
   (``p2pnode/kv/``) and computes whatever did not arrive.

Any failure -- A refuses (other layout, blocks evicted, at its caps, pulls off), A is dead or slow, the stream breaks
-- only means B computes the prefix: the request never fails for it, and the final message says what happened
(``GenerateFinal.pull``). Counters by outcome feed ``p2pnode:kv_pull_*`` and ``p2pnode status``.

Stored segments (approximate reuse) move the same way, decided by the serving node itself (``Router.segment_pulls``):
B asks the holder A for segment keys (``ExportRequest.segments``); A's engine lends the entries its store holds
(``engine.export_segments``); B's engine pulls them into its own store (``engine.fetch_segments``) before the request
runs, which then loads them like segments computed at B. A segment that did not arrive is computed; the pull counts
in the same counters.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.tier_index import TierIndexes
from p2pnode.config import MAX_SEGMENTS, KvPullConfig
from p2pnode.engine.base import Engine
from p2pnode.kv.params import ExportAsk, PullResult, PullSource, SegmentExportAsk, SegmentFetch
from p2pnode.log_limit import LogLimiter
from p2pnode.request import KvSource
from p2pnode.serving.errors import ServeCode, ServeError, TargetFailed
from p2pnode.serving.forward import ForwardClient
from p2pnode.token_wire import read_tokens
from p2pnode.v1 import forward_pb2

T = TypeVar("T")
log = logging.getLogger("p2pnode.kv")

__all__ = ["PULL_OUTCOMES", "KvPulls", "PullCounters", "outcome_kind"]

#: How a pull ends (the label values of p2pnode:kv_pulls): the KV arrived; the transfer failed (the engine computed
#: what did not arrive); the holder refused (its layout, its caps, the blocks no longer cached).
PULL_OUTCOMES = ("ok", "failed", "refused")


@dataclass
class PullCounters:
    """What this node's pulls and exports did (they only grow)."""

    #: Pulls this node attempted, by outcome: ok, failed (the transfer), refused (the holder said no).
    pulls: Counter[str] = field(default_factory=Counter)
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    #: Exports this node answered, by outcome: ok, or why not (layout, evicted, busy, engine).
    exports: Counter[str] = field(default_factory=Counter)
    #: Exports granted whose prefix the engine first loaded (in part) from its host tier, and the blocks it loaded.
    tier_exports: int = 0
    tier_export_blocks: int = 0


def outcome_kind(outcome: str) -> str:
    """The metric label of a pull's outcome text: ok, refused or failed."""
    return outcome.split(":", 1)[0] if outcome.startswith(("refused", "failed")) else "ok"


class KvPulls:
    """This node's pulls and exports (module docstring)."""

    def __init__(
        self,
        node_id: str,
        engine: Engine,
        index: PrefixIndex,
        forwarder: ForwardClient | None,
        config: KvPullConfig,
        *,
        observer: Callable[[str, float], None] | None = None,
        tiers: TierIndexes | None = None,
    ) -> None:
        """``observer``: called with (outcome, seconds) of every finished pull (the metrics' latency histogram).
        ``tiers``: the node's KV tier indexes (``index`` and the tiers below it): a prefix this node's engine evicted
        to its host tier is still lent, the engine loading it back first (None: only what ``index`` holds)."""
        self.node_id = node_id
        self.engine = engine
        self.index = index
        self.tiers = tiers if tiers is not None and tiers.host is not None else None
        self.forwarder = forwarder
        self.config = config
        self.counters = PullCounters()
        self.observer = observer
        self._exports = 0
        self._leased_blocks = 0
        self._log = LogLimiter(log)

    # --- the puller -----------------------------------------------------------------------------------------------

    async def lease(self, source: KvSource, tokens: Sequence[int]) -> PullSource | PullResult:
        """Ask the holder routing named to lease the prefix: what to hand the engine, or why the request computes it."""
        info = self.engine.info
        bs = info.block_size
        blocks = min(source.blocks, (len(tokens) - 1) // bs)
        if not info.kv_layout or self.forwarder is None:
            return PullResult("refused: this node pulls no KV")
        if blocks <= 0 or source.holder == self.node_id:
            return PullResult("refused: nothing to pull")
        request = forward_pb2.ExportRequest(origin=self.node_id, blocks=blocks, kv_layout=info.kv_layout)
        try:
            reply = await self.forwarder.export(
                source.holder, source.address, request, timeout=self.config.export_timeout_s,
                tokens=tokens[: blocks * bs + 1],
            )
        except TargetFailed as e:
            kind = "refused" if e.code in (ServeCode.FAILED_PRECONDITION, ServeCode.RESOURCE_EXHAUSTED) else "failed"
            self._log.warning(f"pull:{source.holder}:{e.code.name}", "KV pull from %s: %s (%s): the prefix is computed",
                              source.holder, e.code.name, e.message)
            return PullResult(f"{kind}: {e.code.name} {e.message}")
        if reply.kv_layout != info.kv_layout or len(reply.block_ids) < blocks:
            return PullResult(f"refused: the holder's layout {reply.kv_layout!r} or lease does not fit")
        return PullSource(source.holder, reply.kv_address, reply.lease, tuple(reply.block_ids), blocks)

    async def pull_segments(
        self, holder: str, holder_address: str, segments: list[tuple[int, list[int]]]
    ) -> tuple[PullResult, float]:
        """Pull stored segments (``(key, tokens)`` each) from ``holder`` into this engine's store: what arrived (as a
        pull's result: ``tokens`` of segments now held here) and the seconds it took. Never raises: a segment that did
        not arrive is computed by the request."""
        started = time.monotonic()
        info = self.engine.info
        fetch_into = getattr(self.engine, "fetch_segments", None)
        if not info.kv_layout or self.forwarder is None or fetch_into is None:
            return PullResult("refused: this node pulls no KV"), 0.0
        request = forward_pb2.ExportRequest(origin=self.node_id, kv_layout=info.kv_layout)
        for key, tokens in segments:
            request.segments.add(key=key, token_ids=tokens)
        try:
            reply = await self.forwarder.export(
                holder, holder_address, request, timeout=self.config.export_timeout_s
            )
        except TargetFailed as e:
            kind = "refused" if e.code in (ServeCode.FAILED_PRECONDITION, ServeCode.RESOURCE_EXHAUSTED) else "failed"
            self._log.warning(f"segments:{holder}:{e.code.name}", "segment pull from %s: %s (%s): computed instead",
                              holder, e.code.name, e.message)
            return PullResult(f"{kind}: {e.code.name} {e.message}"), time.monotonic() - started
        asked = {key: tokens for key, tokens in segments}
        lent = [s for s in reply.segments if s.key in asked and s.tokens == len(asked[s.key])]
        distinct = len({s.key for s in lent}) == len(lent)  # a key lent twice would be assembled twice, every copy
        if reply.kv_layout != info.kv_layout or not lent or len(lent) != len(reply.segments) or not distinct:
            return PullResult(f"refused: the holder's layout {reply.kv_layout!r} or lease does not fit"), 0.0
        fetch = SegmentFetch(
            holder, reply.kv_address, reply.lease, tuple(s.key for s in lent), tuple(s.start for s in lent),
            tuple(s.tokens for s in lent), tuple(t for s in lent for t in asked[s.key]),
        )
        got = await fetch_into(f"segments-{reply.lease[:16]}", fetch)
        outcome = got.outcome
        if outcome == "ok" and len(lent) < len(segments):
            outcome = f"failed: the holder lent {len(lent)} of {len(segments)} segments (the rest evicted there)"
        asked_tokens = sum(len(t) for _, t in segments)
        return PullResult(outcome, got.tokens, got.bytes, got.seconds, asked_tokens), time.monotonic() - started

    def record(self, result: PullResult, seconds: float) -> None:
        """Count a finished pull (every attempt: refused ones too)."""
        c = self.counters
        kind = outcome_kind(result.outcome)
        c.pulls[kind] += 1
        c.pulled_tokens += result.tokens
        c.pulled_bytes += result.bytes
        if self.observer is not None:
            self.observer(kind, seconds)

    def transfer_ended(self, holder: str, result: PullResult, seconds: float) -> None:
        """Count a pull whose lease the holder granted, and say it in one line (rate-limited per holder) when the
        transfer failed (the holder died or stalled mid-way): a refused or failed export is said in ``lease``."""
        if not result.ok:
            self._log.warning(
                f"transfer:{holder}", "KV pull from %s failed after %d of %d tokens (%s): the rest is computed",
                holder, result.tokens, result.asked, result.outcome,
            )
        self.record(result, seconds)

    # --- the holder -----------------------------------------------------------------------------------------------

    async def export(self, request: forward_pb2.ExportRequest, data: bytes | None = None) -> forward_pb2.ExportReply:
        """Lease the blocks a peer asks for (module docstring); ServeError says why not. ``data``: the bytes
        ``request`` was parsed from (its prompt is read from them: ``token_wire.read_tokens``)."""
        try:
            reply = await self._export(request, data)
        except ServeError as e:
            self.counters.exports[e.message.split(":", 1)[0]] += 1
            raise
        self.counters.exports["ok"] += 1
        return reply

    async def _export(self, request: forward_pb2.ExportRequest, data: bytes | None) -> forward_pb2.ExportReply:
        info = self.engine.info
        cfg = self.config
        if not info.kv_layout:
            raise ServeError(ServeCode.UNAVAILABLE, "engine: this node lends no KV")
        if request.kv_layout != info.kv_layout:
            raise ServeError(
                ServeCode.FAILED_PRECONDITION,
                f"kv_layout: {request.kv_layout!r} is not this node's {info.kv_layout!r} (blocks would be noise)",
            )
        if request.segments:
            return await self._export_segments(request)
        tokens, _ = read_tokens(request, "prompt_token_ids", data)
        blocks = request.blocks
        if blocks < 1 or len(tokens) < blocks * info.block_size + 1:
            raise ServeError(
                ServeCode.INVALID_ARGUMENT, f"blocks: {blocks} blocks need more than {len(tokens)} prompt tokens"
            )
        hashes = tuple(block_hashes(tokens, info.block_size))[:blocks]
        held = self.index.match_blocks(hashes)
        from_tier = 0
        if held < blocks and self.tiers is not None:  # the engine loads the rest from its host tier before leasing
            from_tier = self.tiers.depths(hashes, held).host - held
        if held + from_tier < blocks:
            raise ServeError(
                ServeCode.FAILED_PRECONDITION,
                f"evicted: {held + from_tier} of the {blocks} blocks are cached here (engine and host tier)",
            )
        self._admit_export(blocks)
        lease = secrets.token_hex(16)
        ask = ExportAsk(lease, blocks, cfg.lease_ttl_s)
        prompt = tokens[: blocks * info.block_size + 1]
        leased = await self._exporting(self.engine.export(f"export-{lease}", prompt, ask))
        if leased.error:
            raise ServeError(ServeCode.FAILED_PRECONDITION, f"evicted: {leased.error} ({leased.cached_blocks} cached)")
        if from_tier:
            self.counters.tier_exports += 1
            self.counters.tier_export_blocks += from_tier
        self._hold(len(leased.block_ids), cfg.lease_ttl_s)
        return forward_pb2.ExportReply(
            lease=lease,
            kv_address=info.kv_address,
            block_ids=leased.block_ids,
            kv_layout=info.kv_layout,
            lease_ttl_s=cfg.lease_ttl_s,
        )

    def _admit_export(self, blocks: int) -> None:
        """Refuse an export past the caps on exports running here and on blocks leased (RESOURCE_EXHAUSTED)."""
        cfg = self.config
        if self._exports >= cfg.max_exports or self._leased_blocks + blocks > cfg.max_leased_blocks:
            raise ServeError(
                ServeCode.RESOURCE_EXHAUSTED,
                f"busy: {self._exports} exports running, {self._leased_blocks} blocks leased here",
            )

    async def _exporting(self, work: Awaitable[T]) -> T:
        """Run an engine export, counted as running, within ``export_timeout_s`` (past it: UNAVAILABLE)."""
        self._exports += 1
        try:
            return await asyncio.wait_for(work, self.config.export_timeout_s)
        except TimeoutError:
            raise ServeError(ServeCode.UNAVAILABLE, "engine: the export took too long") from None
        finally:
            self._exports -= 1

    async def _export_segments(self, request: forward_pb2.ExportRequest) -> forward_pb2.ExportReply:
        """Lend stored segments: the entries this engine's store holds of those asked (none: FAILED_PRECONDITION)."""
        info = self.engine.info
        cfg = self.config
        lend = getattr(self.engine, "export_segments", None)
        if lend is None:
            raise ServeError(ServeCode.UNAVAILABLE, "engine: this node lends no segments")
        if len(request.segments) > MAX_SEGMENTS:
            raise ServeError(
                ServeCode.INVALID_ARGUMENT, f"segments: at most {MAX_SEGMENTS} per export, got {len(request.segments)}"
            )
        tokens = sum(len(s.token_ids) for s in request.segments)
        if any(not s.token_ids for s in request.segments):
            raise ServeError(ServeCode.INVALID_ARGUMENT, "segments: every segment needs its token_ids")
        blocks = -(-tokens // info.block_size)  # what the lease keeps alive, counted against the same cap as blocks
        self._admit_export(blocks)
        lease = secrets.token_hex(16)
        ask = SegmentExportAsk(
            lease,
            tuple(s.key for s in request.segments),
            tuple(len(s.token_ids) for s in request.segments),
            tuple(t for s in request.segments for t in s.token_ids),
            cfg.lease_ttl_s,
        )
        lent = await self._exporting(lend(f"export-{lease}", ask))
        if lent.error:
            raise ServeError(ServeCode.FAILED_PRECONDITION, f"evicted: {lent.error}")
        self._hold(blocks, cfg.lease_ttl_s)
        reply = forward_pb2.ExportReply(
            lease=lease, kv_address=info.kv_address, kv_layout=info.kv_layout, lease_ttl_s=cfg.lease_ttl_s
        )
        for key, start, length in zip(lent.keys, lent.starts, lent.lengths, strict=True):
            reply.segments.add(key=key, start=start, tokens=length)
        return reply

    def _hold(self, blocks: int, ttl_s: float) -> None:
        """Count leased blocks against the cap for as long as the lease may last."""
        self._leased_blocks += blocks

        def release() -> None:
            self._leased_blocks -= blocks

        asyncio.get_running_loop().call_later(ttl_s, release)
