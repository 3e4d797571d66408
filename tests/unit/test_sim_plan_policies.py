"""Plan policy names in the simulator: explicit fallbacks and ``@k``/``@r`` planner overrides."""

from __future__ import annotations

import functools

import pytest

from p2pnode.engine.simulated.cost import get_profile
from p2pnode.routing.policies import cacheroute
from p2pnode.sim.cluster import make_policy
from p2pnode.sim.plan import PLAN_POLICIES, parse_plan_policy, provider_for


def test_names_and_fallbacks() -> None:
    assert parse_plan_policy("p2p") is None and "p2p" not in PLAN_POLICIES and PLAN_POLICIES.get("flat") is None
    assert parse_plan_policy("cacheroute") == (None, {})
    for fb in ("flat", "p2p", "chwbl"):
        assert PLAN_POLICIES[f"cacheroute-{fb}"] == fb
    # a variant of the bare name binds the policy's default fallback explicitly
    assert PLAN_POLICIES["cacheroute@k512"] == cacheroute.DEFAULT_FALLBACK
    assert parse_plan_policy("cacheroute-chwbl@k512@r0.02") == ("chwbl", {"top_k": 512, "min_rate": 0.02})


def test_overrides_reach_the_planner_and_the_policy_binds_its_fallback() -> None:
    prov = provider_for("cacheroute-flat@k2048@r0.05", decode_token_cost=5.0)
    assert prov is not None
    cfg = prov.config  # type: ignore[attr-defined]
    assert (cfg.top_k, cfg.min_rate, cfg.decode_token_cost) == (2048, 0.05, 5.0)
    assert provider_for("cacheroute").config.top_k == 128  # type: ignore[union-attr]
    assert provider_for("chwbl") is None
    pol = make_policy("cacheroute-chwbl@r0.02", get_profile("llama-3.1-8b-h100"), 3.5)
    assert isinstance(pol, functools.partial) and pol.keywords == {"fallback": "chwbl"}


@pytest.mark.parametrize("name", ["cacheroute@x1", "cacheroute@k", "cacheroute@kten", "cacheroute@k1@k2"])
def test_malformed_overrides_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="bad plan policy override"):
        parse_plan_policy(name)
