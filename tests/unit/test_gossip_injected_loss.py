"""Fault injection on the gossip transport: a fraction of messages dropped, from a set time on, said once."""

from __future__ import annotations

import logging

import pytest

from p2pnode.gossip import GossipConfig
from p2pnode.gossip.grpc_transport import InjectedLoss


def config(**kw: float) -> GossipConfig:
    return GossipConfig(cluster_secret=b"s" * 32, **kw)  # type: ignore[arg-type]


def test_no_loss_configured_drops_nothing() -> None:
    loss = InjectedLoss(config(), "gossip sends")
    assert not any(loss.drops() for _ in range(1000))


def test_the_loss_waits_for_its_start_then_drops_about_its_fraction_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    later = InjectedLoss(config(injected_loss=0.5, injected_loss_after_s=3600.0), "gossip sends")
    assert not any(later.drops() for _ in range(1000))
    now = InjectedLoss(config(injected_loss=0.5), "gossip replies")
    with caplog.at_level(logging.WARNING):
        dropped = sum(now.drops() for _ in range(4000))
    assert 1700 < dropped < 2300
    assert [r.getMessage() for r in caplog.records] == ["fault injection: 50% of gossip replies dropped from now on"]


def test_a_negative_start_is_refused() -> None:
    with pytest.raises(ValueError, match="injected_loss_after_s"):
        config(injected_loss=0.5, injected_loss_after_s=-1.0)
