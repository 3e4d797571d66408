"""Whom a round gossips with: ``fanout`` live peers, reachable ones first, plus chitchat's dead peer and seed.

- Live peers are drawn from the *reachable* members first (they answered a message of ours at their address,
  membership.py); members that never answered us fill what the reachable leave of the fanout -- those that spoke to
  us first, then the *proven* (heartbeat seen advancing), then the rest -- and one of them is asked every round
  anyway. A new member answers within a round or two, while members made up by a secret holder, heartbeating or
  not, never answer, so they never crowd out the real ones.
- One random dead peer with probability dead / (live + 1), so healed partitions reconnect.
- One random seed when none of the targets is a seed and either no peer is known or with probability
  seeds / (live + dead), so a mesh split into islands re-merges through the seeds, and a new node joins through any
  one live seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from p2pnode.gossip.membership import Membership, MemberState

__all__ = ["select_targets"]


def select_targets(
    peers: Iterable[tuple[str, str, MemberState]],
    membership: Membership,
    seeds: list[str],
    fanout: int,
    rng: random.Random,
) -> list[str]:
    """The addresses to gossip with this round (see the module docstring), without duplicates, in draw order.
    ``peers``: (node id, address, state) of every other member with an address."""
    reachable: list[str] = []
    others: tuple[list[str], list[str], list[str]] = ([], [], [])  # spoke to us, proven, the rest
    dead: list[str] = []
    for node_id, address, state in peers:
        if state.usable:
            if membership.reachable(node_id):
                reachable.append(address)
            else:
                others[0 if membership.spoke(node_id) else 1 if membership.proven(node_id) else 2].append(address)
        elif state is MemberState.DEAD:
            dead.append(address)
    live = reachable + [a for tier in others for a in tier]
    targets = rng.sample(reachable, min(fanout, len(reachable)))
    need = max(fanout - len(targets), 1) if len(live) > len(reachable) else 0
    for tier in others:
        taken = rng.sample(tier, min(need, len(tier)))
        targets += taken
        need -= len(taken)
    if dead and rng.random() < len(dead) / (len(live) + 1):
        targets.append(rng.choice(dead))
    seeded = any(t in seeds for t in targets)
    if seeds and not seeded and (not live or rng.random() <= len(seeds) / (len(live) + len(dead))):
        targets.append(rng.choice(seeds))
    return list(dict.fromkeys(targets))
