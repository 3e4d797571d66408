"""Death verdicts: a member one node's own detector declared dead, told to the others, so that those who already
suspect it need not each wait for their own threshold.

Why: phi is judged from when *this* node last heard the member's heartbeat advance, and a far observer hears it
later than a near one -- relays bring it up to ~2 rounds late at 1,000 members. Judged alone, the near observers
declared a killed member dead 7.6 s after the kill and the last survivor 10.2 s (`bench_gossip.py --sizes 1000`).
A verdict travels from the first declarer in the same ~2 rounds a heartbeat takes, so the late observers, which by
then have not heard the member for half the threshold or more, follow it. The declarer pushes its ``down`` key to
``push_fanout`` peers at once, and in a mesh cut into digest shards (digest.py) every Syn names the declarers whose
verdicts its sender holds, whatever their shard, so that their keys spread as fast as with whole digests.

Rules (chitchat has no verdicts; memberlist spreads "dead" messages that the member refutes; Lifeguard shortens a
suspicion with each independent confirmation -- this is the mildest of those):

- a node publishes the deaths it declares, in its ``down`` key, each verdict for ``dead_verdict_rounds`` rounds:
  its **own** detector's (phi above ``phi_threshold``) and those it declared following a peer's verdict -- it
  suspected the member itself, so a verdict is relayed only among nodes that already suspect the member, and a
  member the others hear stops it; relayed, a verdict reaches every suspecting node within a few pushes, where from
  its first declarers alone it took the ~2 rounds of a gossiped key (at 1,000 members the last survivor followed 2 s
  after the first declared). Only for members that answered the node at their address
  (``Membership.established``): a flood's made-up members, dead everywhere once it ends, do not push the real
  verdicts out of the key's ``MAX_DEAD_VERDICTS``;
- a verdict names the member's **life** (its generation) and the **last heartbeat** the declarer heard of it: a
  restarted member is not its earlier life's death, and a member heard here beyond that heartbeat is not dead by
  it -- whether its heartbeat arrived before the verdict, in the same message, or after (a changed ``down`` value
  that still names it re-arms nothing); the declarer withdraws the verdict when it hears the member again;
- a heard verdict is **held**, not acted on: each liveness evaluation (every round and before every staggered Syn,
  with this node's own stalls discounted: ``failure_detector.py``) declares dead a member it holds a verdict for
  once phi is above ``suspect_phi`` -- this node has not heard it for half the threshold either -- within
  ``dead_verdict_rounds`` rounds of first hearing it; a member this node hears is never declared dead by others;
- a member declared dead on a verdict comes back with its next heartbeat, as after any death.

What it gives a secret holder: its verdicts kill only members the others already suspect -- a member that has gone
unheard for half the threshold everywhere -- which a secret holder able to forge heartbeats could do anyway.
Bounds: a ``down`` value names at most ``MAX_DEAD_VERDICTS`` members (~1.2 KB at 27-character ids, ~9 KB at the
256-character limit), written at most once per liveness evaluation; each node holds at most one verdict per member
it knows (``Membership``).
"""
from __future__ import annotations

import msgpack

from p2pnode.gossip.codec import MAX_NODE_ID_CHARS
from p2pnode.gossip.config import MAX_DEAD_VERDICTS

__all__ = ["OwnVerdicts", "decode_verdicts", "encode_verdicts"]


def encode_verdicts(verdicts: list[tuple[str, int, int]]) -> bytes:
    """The ``down`` value naming ``verdicts`` ((node id, generation, last heartbeat heard) triples, newest last; the
    newest ``MAX_DEAD_VERDICTS`` kept)."""
    return msgpack.packb([list(v) for v in verdicts[-MAX_DEAD_VERDICTS:]])


def decode_verdicts(value: bytes | None) -> list[tuple[str, int, int]]:
    """The (node id, generation, heartbeat) triples a ``down`` value names; an empty list for a value that is not
    one (a peer's bug must not reach the membership), malformed entries skipped."""
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
        (item[0], item[1], item[2])
        for item in items
        if type(item) is list and len(item) == 3 and type(item[0]) is str and 0 < len(item[0]) <= MAX_NODE_ID_CHARS
        and type(item[1]) is int and item[1] >= 0 and type(item[2]) is int and item[2] >= 0
    ]


class OwnVerdicts:
    """The deaths this node's own detector declared in the last ``keep_s`` seconds: what its ``down`` key says.

    Invariant: at most ``MAX_DEAD_VERDICTS`` entries, in the order declared; a member declared again (a later life,
    or dead again after coming back) moves to the end with its newest life and heartbeat."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._declared: dict[str, tuple[int, int, float]] = {}  # member -> (generation, heartbeat, declared at)

    def __len__(self) -> int:
        return len(self._declared)

    def declare(self, node_id: str, generation: int, heartbeat: int, now: float) -> None:
        self._declared.pop(node_id, None)
        self._declared[node_id] = (generation, heartbeat, now)
        while len(self._declared) > MAX_DEAD_VERDICTS:
            del self._declared[next(iter(self._declared))]

    def withdraw(self, node_id: str) -> bool:
        """The member was heard again (or forgotten): no verdict on it any more; whether there was one."""
        return self._declared.pop(node_id, None) is not None

    def expire(self, now: float) -> bool:
        """Drop the verdicts older than ``keep_s``; whether any was dropped."""
        old = [n for n, (_, _, at) in self._declared.items() if now - at > self.keep_s]
        for node_id in old:
            del self._declared[node_id]
        return bool(old)

    def value(self) -> bytes:
        return encode_verdicts([(node_id, gen, hb) for node_id, (gen, hb, _) in self._declared.items()])
