"""The link figure a KV pull is priced with, per holder (``routing/links.py``): it follows the pulls an ingress saw
finish, within bounds, whatever a serving peer reports."""

from __future__ import annotations

import math

from p2pnode.routing.links import MAX_LINK_FACTOR, LinkEstimates

GBPS = 100e9 / 8


def test_a_holder_moves_toward_what_its_pulls_measure() -> None:
    links = LinkEstimates(GBPS)
    for _ in range(50):
        links.observe("slow", 1 << 30, (1 << 30) / (GBPS / 10), ok=True)  # a tenth of the configured link
    assert math.isclose(links.get("slow"), GBPS / 10, rel_tol=0.01)
    assert links.get("other") == GBPS


def test_reports_no_link_gives_never_price_a_holder_free_or_off() -> None:
    """A serving peer reports its pull's bytes and seconds: 2**64 bytes in 5e-324 s made a holder's figure inf for
    good (every pull from it priced free), NaN seconds made it NaN (its pulls off)."""
    links = LinkEstimates(GBPS)
    for _ in range(20):
        links.observe("a", 2**64 - 1, 5e-324, ok=True)
        links.observe("b", 1 << 30, float("nan"), ok=True)
        links.observe("c", 1 << 30, float("inf"), ok=True)
        links.observe("d", -(1 << 30), 1.0, ok=True)
    assert links.get("a") == GBPS * MAX_LINK_FACTOR
    assert links.get("b") == links.get("c") == links.get("d") == GBPS  # not measured: the configured figure
    for _ in range(50):
        links.observe("e", 0, 1.0, ok=False)  # failing pulls
    assert links.get("e") == GBPS / MAX_LINK_FACTOR
    links.forget("a")
    assert links.get("a") == GBPS
