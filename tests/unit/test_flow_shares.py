"""The mesh-wide share rule the node and the simulator both charge by: only work beyond a weighted equal share."""

from __future__ import annotations

import pytest

from p2pnode.flow.shares import excess_over_share


def test_only_the_tenant_served_beyond_its_share_is_charged_and_by_the_excess() -> None:
    served = {"heavy": 900.0, "light": 100.0}
    assert excess_over_share(served, [], lambda t: 1.0) == {"heavy": pytest.approx(400.0)}


def test_a_tenant_waiting_here_and_served_nowhere_counts_in_the_share() -> None:
    """Three tenants share 900: the one served 900 elsewhere is 600 over its share of 300."""
    assert excess_over_share({"heavy": 900.0}, ["a", "b"], lambda t: 1.0) == {"heavy": pytest.approx(600.0)}


def test_weights_set_the_shares_and_equal_service_charges_nobody() -> None:
    weights = {"gold": 3.0, "free": 1.0}
    assert excess_over_share({"gold": 750.0, "free": 250.0}, [], weights.__getitem__) == {}
    assert excess_over_share({"gold": 500.0, "free": 500.0}, [], weights.__getitem__) == {"free": pytest.approx(250.0)}
    assert excess_over_share({}, ["a"], lambda t: 1.0) == {}
