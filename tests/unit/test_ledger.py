"""The in-flight ledger against a plain model of it: under any sequence of sends, ends (of live, dropped, unknown
tickets), reads at moving report times and forgotten peers, ``since`` counts the sends at or after the report time
that have not ended, with their tokens, and a peer with none left is gone from ``peers()``."""

from __future__ import annotations

import random

from p2pnode.routing.ledger import InFlightLedger


def test_the_ledger_counts_what_a_plain_list_of_sends_counts() -> None:
    rng = random.Random(7)
    for trial in range(300):
        ledger = InFlightLedger()
        model: dict[str, list[tuple[int, float, int]]] = {}  # peer -> (ticket, sent at, tokens), live sends
        floor: dict[str, float] = {}  # peer -> the latest report time read: older sends never count again
        peers = [f"p{i}" for i in range(rng.choice([1, 3, 8]))]
        issued: list[tuple[str, int]] = []
        now = 0.0
        for _ in range(rng.randrange(1, 200)):
            now += rng.choice([0.0, 0.01, 0.3])
            peer, op = rng.choice(peers), rng.random()
            if op < 0.45:
                tokens = rng.choice([0, 1, 37, 4096])
                ticket = ledger.begin(peer, now, tokens)
                model.setdefault(peer, []).append((ticket, now, tokens))
                issued.append((peer, ticket))
            elif op < 0.7 and issued:
                peer, ticket = rng.choice(issued)
                if rng.random() < 0.1:
                    ticket += 10_000  # unknown: a no-op
                ledger.end(peer, ticket)
                model[peer] = [s for s in model.get(peer, []) if s[0] != ticket]
            elif op < 0.97:
                since = max(floor.get(peer, 0.0), now - rng.choice([0.0, 0.2, 1.0, 5.0]))
                floor[peer] = since
                model[peer] = [s for s in model.get(peer, []) if s[1] >= since]
                expected = (len(model[peer]), sum(tokens for _, _, tokens in model[peer]))
                assert ledger.since(peer, since) == expected, trial
            else:
                ledger.forget(peer)
                model[peer] = []
            assert set(ledger.peers()) == {p for p, sends in model.items() if sends}, trial
