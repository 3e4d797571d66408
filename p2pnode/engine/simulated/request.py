"""One simulated request: what the workload generated, plus what happened to it on its way through the mesh.

A plain ``__slots__`` class rather than a dataclass: a million of these are created per run, and the simulator
mutates them at every stage (routing, queueing, prefill, decode), so construction and attribute access must be
cheap. Invariants:
- ``chain[:n_blocks]`` are the p2pnode block hashes of the request's full token blocks (prompt, then the full
  blocks of prompt + output, which the engine caches when the request finishes); ``cids[i]`` is the content id
  that ``BlockSpace`` turns into block i's tokens. Both lists may be longer (a conversation's lists keep
  growing after this turn) and are shared with later turns, never modified below ``n_blocks``.
- ``n_prompt_blocks == prompt_tokens // block_size`` and ``n_blocks == (prompt_tokens + output_tokens) //
  block_size``.
- ``follow`` is a request released ``follow_gap_s`` after this one finishes (closed loop: an agent's next step).
- ``pull_lo <= pull_hi``: blocks ``chain[pull_lo:pull_hi]`` were pulled to the target (``pull_hi`` 0: nothing was);
  they count as cached at admission only if the target still holds ``chain[:pull_lo]`` then (``kvcache.admit``).
- ``segments`` (a workload whose prompts name reusable segments: ``engine/simulated/segments.SegmentedPrompt``)
  holds the request's real tokens; then ``chain`` hashes them (``block_hashes``) and ``cids`` is unused.
  ``loaded_tokens``: prompt tokens loaded from the serving node's segment store (not prefilled, not in
  ``cached_tokens``, which stays the cached prefix); ``phase_stops``: values of ``remaining`` a prefill step may not
  cross (its approximate phases), largest first.
- KV tiers below the engine (``engine/simulated/tiers.py``): ``tier_host_tokens`` and ``tier_disk_tokens`` of
  ``cached_tokens`` were loaded from the node's host and disk tiers at admission (neither with a pull);
  ``tier_load_s`` is how long the request waited for them before its prefill; ``tier_offer_from`` is the first block
  its prefill offers to the host tier (after what it loaded).
- Flow control (the simulator's ``sim/admission.py``; docs/simulator.md, "Tenants and priorities"): ``session`` is
  the workload's stream the request continues (a conversation, an agent session; -1: none), ``tenant`` and
  ``priority`` (lower first, vLLM's order; 0 by default) are what the client sent; ``queued_at`` is when it joined its
  node's admission queue (-1: it never waited there), ``queue_wait_s`` how long it waited there, and ``shed`` whether
  it was answered from that queue unserved (its limit passed, or the queue was full). ``preempted_tokens``: output
  tokens it had produced when a higher-priority request preempted it (``batching.py``); while it is resumed they
  count in ``prompt_tokens`` (recomputed, as vLLM recomputes them) and not in ``output_tokens``; a preempted
  request reports what its first admission reused (``first_admission``: its cached, host-tier, disk-tier and pulled
  tokens then), as vLLM sets ``num_cached_tokens`` once -- its resumption reuses the blocks it computed itself.
  Preemption keeps ``n_blocks <= len(chain)`` (a trace's chain holds its prompt's blocks only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pnode.engine.simulated.segments import SegmentedPrompt

__all__ = ["PULL_FAILED", "PULL_FULL", "PULL_NONE", "PULL_PARTIAL", "PULL_UNNEEDED", "SimRequest"]

#: What became of a request's KV pull (``pull_outcome``; the simulator's ``sim/pulls.py``): none asked; every block
#: asked for moved; some moved (the holder had evicted the rest); none moved (the holder held nothing past the
#: target's own match); none needed (the target held them all by the time it looked).
PULL_NONE, PULL_FULL, PULL_PARTIAL, PULL_FAILED, PULL_UNNEEDED = 0, 1, 2, 3, 4


class SimRequest:
    """A request and its fate (times are simulated seconds)."""

    __slots__ = (
        "anon_blocks",
        "arrival",
        "backlog_tokens",
        "cached_tokens",
        "chain",
        "cids",
        "cls",
        "decode_start_step",
        "dropped",
        "est_match_blocks",
        "first_admission",
        "follow",
        "follow_gap_s",
        "forwarded",
        "ingress",
        "key",
        "loaded_tokens",
        "n_blocks",
        "n_prompt_blocks",
        "output_tokens",
        "phase_stops",
        "preempted_tokens",
        "priority",
        "prompt_tokens",
        "pull_blocks",
        "pull_bytes",
        "pull_hi",
        "pull_holder",
        "pull_lo",
        "pull_outcome",
        "pull_s",
        "pull_t0",
        "pull_wait_s",
        "pulled_tokens",
        "queue_wait_s",
        "queued_at",
        "remaining",
        "rid",
        "segments",
        "session",
        "shed",
        "t_done",
        "t_first",
        "target",
        "tenant",
        "ticket",
        "tier_disk_tokens",
        "tier_host_tokens",
        "tier_load_s",
        "tier_offer_from",
    )

    def __init__(
        self,
        rid: int,
        arrival: float,
        key: str,
        prompt_tokens: int,
        output_tokens: int,
        chain: list[int],
        cids: list[int],
        block_size: int,
        cls: str = "",
    ) -> None:
        self.rid = rid
        self.arrival = arrival
        self.key = key  # routing key given by the client; "" means derive it from the leading blocks
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.chain = chain
        self.cids = cids
        self.n_prompt_blocks = prompt_tokens // block_size
        self.n_blocks = (prompt_tokens + output_tokens) // block_size
        self.cls = cls
        self.follow: SimRequest | None = None
        self.follow_gap_s = 0.0
        # flow control (sim/admission.py): who sent it, how urgent, and its wait in its node's admission queue
        self.session = -1  # the conversation or agent session it belongs to (the workload's stream), -1: none
        self.tenant = ""
        self.priority = 0
        self.queued_at = -1.0
        self.queue_wait_s = 0.0
        self.shed = False
        self.preempted_tokens = 0
        self.first_admission: tuple[int, int, int, int] | None = None
        # routing
        self.ingress = -1
        self.target = -1
        self.forwarded = False
        self.ticket = 0  # the ingress router's ticket for this request's send (its in-flight ledger entry)
        self.est_match_blocks = 0
        # KV pull (sim/pulls.py): asked by the routing decision, then what moved and what it cost
        self.pull_holder = -1  # node index the prefix is pulled from (-1: no pull)
        self.pull_blocks = 0  # leading blocks of the prompt the decision wants at the target
        self.pull_lo = 0  # blocks chain[pull_lo:pull_hi] moved
        self.pull_hi = 0
        self.pull_bytes = 0
        self.pull_outcome = PULL_NONE
        self.pull_t0 = 0.0  # reached its target and asked for the pull
        self.pull_wait_s = 0.0  # waited for the holder's link
        self.pull_s = 0.0  # from reaching the target to joining its queue
        self.pulled_tokens = 0  # of cached_tokens, those pulled (counted at admission)
        # segments (engine/simulated/segments.py)
        self.segments: SegmentedPrompt | None = None
        self.loaded_tokens = 0
        self.phase_stops: list[int] | None = None
        # KV tiers (engine/simulated/tiers.py)
        self.tier_host_tokens = 0
        self.tier_disk_tokens = 0
        self.tier_load_s = 0.0
        self.tier_offer_from = 0
        # engine
        self.cached_tokens = 0
        self.anon_blocks = 0  # KV blocks held that carry no cached hash (yet)
        self.backlog_tokens = 0  # uncached prompt tokens as the engine's cache stood when it arrived
        self.remaining = 0  # prompt tokens still to prefill
        self.decode_start_step = 0
        self.t_first = -1.0
        self.t_done = -1.0
        self.dropped = False

    def __repr__(self) -> str:
        return (
            f"SimRequest(rid={self.rid}, t={self.arrival:.3f}, key={self.key!r}, prompt={self.prompt_tokens}, "
            f"output={self.output_tokens}, blocks={self.n_prompt_blocks}/{self.n_blocks})"
        )
