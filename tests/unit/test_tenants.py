"""Tenants: ``--tenant`` parsing, who a request is for (key, then header, then default), metric labels."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from p2pnode.api.auth import ApiKeys
from p2pnode.cli.args import tenant_spec
from p2pnode.config import DEFAULT_TENANT, FlowConfig, TenantSpec
from p2pnode.serving.errors import ServeCode, ServeError
from p2pnode.serving.tenants import Caller, TenantLabels, Tenants, parse_tenant


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("acme=sk-acme", TenantSpec("acme", "sk-acme")),
        ("acme=sk-acme,weight=2", TenantSpec("acme", "sk-acme", weight=2.0)),
        ("batch,weight=0.5,rps=10,tps=50000", TenantSpec("batch", "", 0.5, 10.0, 50000.0)),
        ("default,rps=3", TenantSpec("default", requests_per_s=3.0)),
        ("*,tps=1000", TenantSpec("*", tokens_per_s=1000.0)),
        (" acme = k ", TenantSpec("acme", "k")),
        ("live=sk-live,priority=-1", TenantSpec("live", "sk-live", priority=-1)),
    ],
)
def test_tenant_flag_parses(text: str, spec: TenantSpec) -> None:
    assert parse_tenant(text) == spec
    assert parse_tenant(text).key == spec.key


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "tenant name"),
        ("=k", "tenant name"),
        ("acme,weight=0", "weight"),
        ("acme,weight=-1", "weight"),
        ("acme,rps=-1", "requests_per_s"),
        ("acme,rps=inf", "requests_per_s"),
        ("acme,burst=3", "expected one of"),
        ("acme,weight", "expected one of"),
        ("acme,rps=fast", "not a number"),
        ("acme,rps=1,rps=2", "twice"),
        ("acme,priority=0.5", "not an integer"),
        ("acme,priority=4294967296", "32-bit integer"),
        ("*=key", "cannot have a key"),
        ("x" * 65, "tenant name"),
    ],
)
def test_bad_tenant_flags_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_tenant(text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME"):
        tenant_spec(text)


def test_a_bad_tenant_flag_never_echoes_the_key() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        tenant_spec("acme=sk-secret,weight=0")
    assert "sk-secret" not in str(err.value)


def test_tenants_named_twice_or_sharing_a_key_are_refused() -> None:
    with pytest.raises(ValueError, match="named twice"):
        FlowConfig(tenants=(TenantSpec("a", "k1"), TenantSpec("a", "k2")))
    with pytest.raises(ValueError, match="same key"):
        FlowConfig(tenants=(TenantSpec("a", "k"), TenantSpec("b", "k")))


def tenants(header: str = "x-tenant") -> Tenants:
    flow = FlowConfig(
        tenant_header=header,
        tenants=(
            TenantSpec("acme", "sk-acme", weight=3.0, requests_per_s=5.0),
            TenantSpec("free", tokens_per_s=100.0),
            TenantSpec("*", requests_per_s=1.0),
        ),
    )
    return Tenants(flow)


def keys_of(t: Tenants) -> ApiKeys:
    return ApiKeys(["sk-plain"], t.key_pairs)


def test_a_key_names_its_tenant_before_the_header() -> None:
    t = tenants()
    keys = keys_of(t)
    assert t.name(keys.tenant_of("Bearer sk-acme"), None) == "acme"
    assert t.name(keys.tenant_of("Bearer sk-acme"), "free") == "acme"  # a key holder cannot claim another tenant
    assert t.name(keys.tenant_of("Bearer sk-plain"), "free") == "free"  # a key that names no tenant: the header does
    assert t.name(keys.tenant_of("Bearer sk-plain"), None) == DEFAULT_TENANT
    assert t.name(keys.tenant_of(None), None) == DEFAULT_TENANT
    assert tenants(header="").name("", "free") == DEFAULT_TENANT  # no header configured: never read


def test_a_bad_header_value_is_invalid_argument() -> None:
    for value in ("x" * 65, "a\nb"):
        with pytest.raises(ServeError) as err:
            tenants().name("", value)
        assert err.value.code == ServeCode.INVALID_ARGUMENT and err.value.field == "x-tenant"


def test_the_priority_header_gives_a_calls_default_priority_over_its_tenants() -> None:
    flow = FlowConfig(
        tenant_header="x-tenant", priority_header="x-priority", tenants=(TenantSpec("live", "sk-live", priority=-1),)
    )
    t = Tenants(flow)

    def headers(**values: str) -> Callable[[str], str | None]:
        return {k.replace("_", "-"): v for k, v in values.items()}.get

    assert t.caller("live", headers()) == Caller("live", -1)  # the tenant's default
    assert t.caller("live", headers(x_priority="3")) == Caller("live", 3)  # the header's, per request, wins
    assert t.caller("", headers(x_tenant="batch", x_priority=" -2 ")) == Caller("batch", -2)
    assert t.caller("", headers(x_priority="")) == Caller(DEFAULT_TENANT, 0)
    assert tenants().caller("", headers(x_priority="-5")) == Caller(DEFAULT_TENANT, 0)  # no header configured
    for bad in ("high", "1.5", str(2**31)):
        with pytest.raises(ServeError) as err:
            t.caller("", headers(x_priority=bad))
        assert err.value.code == ServeCode.INVALID_ARGUMENT and err.value.field == "x-priority", bad


def test_weights_and_limits_fall_back_to_star_then_unlimited() -> None:
    t = tenants()
    assert t.weight("acme") == 3.0 and t.weight("someone") == 1.0
    assert t.rate_limit("acme").requests_per_s == 5.0
    assert t.rate_limit("free").tokens_per_s == 100.0 and t.rate_limit("free").requests_per_s == 0.0
    assert t.rate_limit("someone").requests_per_s == 1.0  # '*': every tenant without its own
    assert not Tenants(FlowConfig()).rate_limit("someone").limited
    assert t.configured == ("acme", "free")


def test_tenant_keys_are_accepted_keys() -> None:
    keys = keys_of(tenants())
    assert keys.enabled
    assert keys.accepts("Bearer sk-acme") and keys.accepts("Bearer sk-plain")
    assert not keys.accepts("Bearer sk-nobody")
    assert keys.tenant_of("Bearer sk-nobody") == "" and keys.tenant_of(None) == ""
    assert not ApiKeys([], Tenants(FlowConfig(tenants=(TenantSpec("h"),))).key_pairs).enabled  # header-only: no auth
    assert ApiKeys(["a"]).tenant_of("Bearer a") == ""


def test_metric_labels_are_capped_with_an_other_bucket() -> None:
    labels = TenantLabels(("acme", "free"), limit=4)
    assert [labels(t) for t in ("acme", "default", "x", "y", "z", "free", "x")] == [
        "acme",
        "default",
        "x",
        "other",
        "other",
        "free",
        "x",
    ]


def test_serve_flags_and_a_config_file_make_the_flow_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from p2pnode.cli import build_parser
    from p2pnode.cli.serve import flow_config_of
    from p2pnode.config_file import expand

    config = tmp_path / "node.yaml"
    config.write_text("tenant: ['acme=sk-a,weight=2', 'batch,tps=500']\ntenant-header: x-tenant\n")
    parser = build_parser()
    argv = [
        "serve",
        "--model",
        "m",
        "--node-id",
        "n",
        "--config",
        str(config),
        "--max-queue-length",
        "8",
        "--max-queue-seconds",
        "2.5",
    ]
    flow = flow_config_of(parser.parse_args(expand(argv, {"serve": parser.serve_parser})))
    assert (flow.max_queue_length, flow.max_queue_seconds, flow.tenant_header) == (8, 2.5, "x-tenant")
    assert flow.tenants == (TenantSpec("acme", "sk-a", weight=2.0), TenantSpec("batch", tokens_per_s=500.0))
    defaults = flow_config_of(parser.parse_args(["serve", "--model", "m", "--node-id", "n"]))
    assert defaults == FlowConfig()
