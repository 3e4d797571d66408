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
"""

from __future__ import annotations

__all__ = ["SimRequest"]


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
        "follow",
        "follow_gap_s",
        "forwarded",
        "ingress",
        "key",
        "n_blocks",
        "n_prompt_blocks",
        "output_tokens",
        "prompt_tokens",
        "remaining",
        "rid",
        "t_done",
        "t_first",
        "target",
        "ticket",
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
        # routing
        self.ingress = -1
        self.target = -1
        self.forwarded = False
        self.ticket = 0  # the ingress router's ticket for this request's send (its in-flight ledger entry)
        self.est_match_blocks = 0
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
