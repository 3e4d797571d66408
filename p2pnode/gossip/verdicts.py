"""Death verdicts: a member one node's own detector declared dead, told to the others, so that those who already
suspect it need not each wait for their own threshold.

Why: phi is judged from when *this* node last heard the member's heartbeat advance, and a far observer hears it
later than a near one -- relays bring it up to ~2 rounds late at 1,000 members. Judged alone, the near observers
declared a killed member dead 7.6 s after the kill and the last survivor 10.2 s (`bench_gossip.py --sizes 1000`).
A verdict travels from the first declarer in the same ~2 rounds a heartbeat takes, so the late observers, which by
then have not heard the member for half the threshold or more, follow it.

Rules (chitchat has no verdicts; memberlist spreads "dead" messages that the member refutes; Lifeguard shortens a
suspicion with each independent confirmation -- this is the mildest of those):

- a node publishes only what its **own** detector declared (phi above ``phi_threshold``) in its ``down`` key, each
  verdict for ``dead_verdict_rounds`` rounds, never a verdict it adopted: one node's mistake does not relay itself;
- a verdict names the member's **life** (its generation): a restarted member is not its earlier life's death;
- a peer's verdict confirms only a member this node already **suspects** (phi above ``suspect_phi``), then or within
  ``dead_verdict_rounds`` rounds of hearing it, and not once the member's heartbeat has advanced here since: a member
  this node hears is never declared dead by others;
- a member declared dead on a verdict comes back with its next heartbeat, as after any death.

What it gives a secret holder: its verdicts kill only members the others already suspect -- a member that has
gone unheard for half the threshold everywhere -- which a secret holder able to forge heartbeats could do anyway.
Bounds: a ``down`` value names at most ``MAX_DEAD_VERDICTS`` members (~1 KB at 27-character ids); each node heeds
at most one verdict per member it knows (``Membership``).
"""

from __future__ import annotations

import msgpack

from p2pnode.gossip.codec import MAX_NODE_ID_CHARS
from p2pnode.gossip.config import MAX_DEAD_VERDICTS

__all__ = ["OwnVerdicts", "decode_verdicts", "encode_verdicts"]


def encode_verdicts(verdicts: list[tuple[str, int]]) -> bytes:
    """The ``down`` value naming ``verdicts`` ((node id, generation) pairs, newest last; the newest
    ``MAX_DEAD_VERDICTS`` kept)."""
    return msgpack.packb([[node_id, generation] for node_id, generation in verdicts[-MAX_DEAD_VERDICTS:]])


def decode_verdicts(value: bytes | None) -> list[tuple[str, int]]:
    """The (node id, generation) pairs a ``down`` value names; an empty list for a value that is not one (a peer's
    bug must not reach the membership), entries past ``MAX_DEAD_VERDICTS`` ignored."""
    if not value:
        return []
    try:
        items = msgpack.unpackb(value, raw=False, max_array_len=MAX_DEAD_VERDICTS, max_map_len=0,
                                max_str_len=4 * MAX_NODE_ID_CHARS, max_bin_len=0, max_ext_len=0)
    except Exception:  # msgpack's errors, or an array longer than any honest node writes
        return []
    if type(items) is not list:
        return []
    return [
        (item[0], item[1])
        for item in items
        if type(item) is list and len(item) == 2 and type(item[0]) is str and 0 < len(item[0]) <= MAX_NODE_ID_CHARS
        and type(item[1]) is int and item[1] >= 0
    ]


class OwnVerdicts:
    """The deaths this node's own detector declared in the last ``keep_s`` seconds: what its ``down`` key says.

    Invariant: at most ``MAX_DEAD_VERDICTS`` entries, in the order declared; a member declared again (a later life,
    or dead again after coming back) moves to the end with its newest life."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._declared: dict[str, tuple[int, float]] = {}  # member -> (generation, declared at)

    def __len__(self) -> int:
        return len(self._declared)

    def declare(self, node_id: str, generation: int, now: float) -> None:
        self._declared.pop(node_id, None)
        self._declared[node_id] = (generation, now)
        while len(self._declared) > MAX_DEAD_VERDICTS:
            del self._declared[next(iter(self._declared))]

    def expire(self, now: float) -> bool:
        """Drop the verdicts older than ``keep_s``; whether any was dropped."""
        old = [n for n, (_, at) in self._declared.items() if now - at > self.keep_s]
        for node_id in old:
            del self._declared[node_id]
        return bool(old)

    def value(self) -> bytes:
        return encode_verdicts([(node_id, generation) for node_id, (generation, _) in self._declared.items()])
