"""Plan policy names in the simulator and on the node: explicit fallbacks and ``@k``/``@r`` planner overrides, all
resolved through the policy's spec."""

from __future__ import annotations

import pytest

from p2pnode.cost import get_profile
from p2pnode.routing.policies import cacheroute, get_spec
from p2pnode.sim.cluster import policy_spec
from p2pnode.sim.plan import provider_for


def test_names_and_fallbacks() -> None:
    assert not get_spec("p2p").reads.plan and not get_spec("flat").reads.plan
    assert get_spec("cacheroute").reads.plan and dict(get_spec("cacheroute").params) == {}
    for fb in ("flat", "p2p", "chwbl"):
        spec = get_spec(f"cacheroute-{fb}")
        assert spec.name == f"cacheroute-{fb}" and spec.params["fallback"] == fb and spec.reads.plan
    # a variant of the bare name keeps the policy's default fallback
    assert get_spec("cacheroute@k512").effective["fallback"] == cacheroute.DEFAULT_FALLBACK
    spec = get_spec("cacheroute-chwbl@k512@r0.02")
    assert (dict(spec.params), dict(spec.planner)) == ({"fallback": "chwbl"}, {"top_k": 512, "min_rate": 0.02})


def test_overrides_reach_the_planner_and_the_policy_binds_its_fallback() -> None:
    prov = provider_for(get_spec("cacheroute-flat@k2048@r0.05"), decode_token_cost=5.0)
    assert prov is not None
    cfg = prov.config  # type: ignore[attr-defined]
    assert (cfg.top_k, cfg.min_rate, cfg.decode_token_cost) == (2048, 0.05, 5.0)
    assert provider_for(get_spec("cacheroute")).config.top_k == 128  # type: ignore[union-attr]
    assert provider_for(get_spec("chwbl")) is None
    spec = policy_spec("cacheroute-chwbl@r0.02", get_profile("llama-3.1-8b-h100"), 3.5)
    assert dict(spec.params) == {"fallback": "chwbl"}  # no TTFT threshold to bind: it steers by none
    assert not spec.reads.sparse and spec.reads.homes == 0  # a chwbl fallback needs every peer, and no home


@pytest.mark.parametrize("name", ["cacheroute@x1", "cacheroute@k", "cacheroute@kten", "cacheroute@k1@k2"])
def test_malformed_overrides_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="bad override"):
        get_spec(name)
