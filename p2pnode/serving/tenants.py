"""Tenants: who a request is for, which decides its share of a full node and how fast it may send.

A tenant is named, in this order, by the API key the request presents (``--tenant NAME=KEY``), by the configured
tenant header (``--tenant-header``: set by a gateway in front of the mesh), or is ``default``. A key's tenant wins
over the header, so a client holding a tenant's key cannot pass itself off as another tenant by writing the header.
The ingress names the tenant once; it travels with a forwarded request (``ForwardRequest.tenant``), so the node that
serves it queues it under the same name.

``--tenant`` is one flag family: ``NAME[=KEY][,weight=W][,rps=R][,tps=T][,priority=P]`` -- the key that names the
tenant (none: only the header names it), its weight in the queue's fair share (default 1), its rate limits in
requests and tokens per second (0 or absent: unlimited; tokens are the prompt's plus ``max_tokens``), and the
priority of its requests that name none (0 or absent: the default; a request's own ``priority`` wins). ``NAME``
``*`` is every tenant without a ``--tenant`` of its own (a default limit for header-named tenants), and ``default``
may be given limits like any other.

A request whose body names no priority takes, in this order, the priority header's (``--priority-header``: set by a
gateway, per request) or its tenant's. Who a call is for and that priority are its ``Caller``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from p2pnode.config import (
    DEFAULT_TENANT,
    MAX_TENANT_CHARS,
    MAX_TENANT_LABELS,
    OTHER_TENANT_LABEL,
    FlowConfig,
    TenantSpec,
)
from p2pnode.flow.rate_limit import RateLimit
from p2pnode.serving.errors import ServeCode, ServeError

__all__ = ["DEFAULT_CALLER", "TENANT_OPTIONS", "Caller", "TenantLabels", "Tenants", "parse_tenant"]

#: ``--tenant`` options -> TenantSpec fields.
TENANT_OPTIONS = {"weight": "weight", "rps": "requests_per_s", "tps": "tokens_per_s", "priority": "priority"}


def parse_tenant(text: str) -> TenantSpec:
    """One ``--tenant NAME[=KEY][,weight=W][,rps=R][,tps=T][,priority=P]`` (module docstring); raise ValueError
    saying what is wrong. A key may not contain a comma (none of the usual key alphabets has one)."""
    head, *options = text.split(",")
    name, _, key = head.partition("=")
    values: dict[str, float | int] = {}
    for option in options:
        option_name, sep, value = option.partition("=")
        field = TENANT_OPTIONS.get(option_name.strip())
        if not sep or field is None:  # not quoted: it may be the rest of a key holding a comma (a secret)
            where = f"option {option_name.strip()!r}" if sep else "a part with no '='"
            raise ValueError(f"{where}: expected one of {', '.join(f'{o}=NUMBER' for o in TENANT_OPTIONS)}")
        if field in values:
            raise ValueError(f"{option_name.strip()} is given twice")
        try:
            values[field] = int(value) if field == "priority" else float(value)
        except ValueError:
            kind = "an integer" if field == "priority" else "a number"
            raise ValueError(f"{option!r}: {value!r} is not {kind}") from None
    return TenantSpec(name.strip(), key.strip(), **values)


@dataclass(frozen=True)
class Caller:
    """Who a call is for, and the priority of its requests whose bodies name none (0: the default)."""

    tenant: str = DEFAULT_TENANT
    priority: int = 0


#: A call nobody named: the default tenant at the default priority.
DEFAULT_CALLER = Caller()


class Tenants:
    """The node's tenants (``FlowConfig``): their weights and rate limits, and who a request is for. The keys that
    name them are the client APIs' (``api/auth.ApiKeys``, built with ``key_pairs``)."""

    def __init__(self, flow: FlowConfig) -> None:
        self.flow = flow
        self.header = flow.tenant_header.lower()
        self.priority_header = flow.priority_header.lower()
        self._specs: Mapping[str, TenantSpec] = {t.name: t for t in flow.tenants}
        self._default_limit = RateLimit()

    @property
    def key_pairs(self) -> list[tuple[str, str]]:
        """(key, tenant) of every tenant a key names: accepted like ``--api-key``, and naming its tenant."""
        return [(t.key, t.name) for t in self.flow.tenants if t.key]

    def name(self, keyed: str, header_value: str | None) -> str:
        """The tenant of a request whose key names ``keyed`` ("": none) with ``header_value`` in the tenant header."""
        if keyed:
            return keyed
        if self.header and header_value:
            check_name(header_value, self.header)
            return header_value
        return DEFAULT_TENANT

    def caller(self, keyed: str, header: Callable[[str], str | None]) -> Caller:
        """Who a call whose key names ``keyed`` ("": none) is for, and its requests' default priority; ``header``:
        a header's value by its lower-case name (None: absent). Raise INVALID_ARGUMENT naming a bad header."""
        tenant = self.name(keyed, header(self.header) if self.header else None)
        value = header(self.priority_header) if self.priority_header else None
        if value is None or not value.strip():
            return Caller(tenant, self.priority(tenant))
        try:
            priority = int(value.strip())
        except ValueError:
            priority = None
        if priority is None or not -(2**31) <= priority < 2**31:
            raise ServeError(ServeCode.INVALID_ARGUMENT, f"{self.priority_header}: expected a 32-bit integer (vLLM's "
                             f"priority, lower first), got {value[:40]!r}", self.priority_header)
        return Caller(tenant, priority)

    def weight(self, tenant: str) -> float:
        return self.flow.spec_of(tenant).weight

    def priority(self, tenant: str) -> int:
        """The priority of the tenant's requests that name none (0: the default)."""
        return self.flow.spec_of(tenant).priority

    def rate_limit(self, tenant: str) -> RateLimit:
        spec = self.flow.spec_of(tenant)
        if not spec.requests_per_s and not spec.tokens_per_s:
            return self._default_limit
        return RateLimit(requests_per_s=spec.requests_per_s, tokens_per_s=spec.tokens_per_s)

    @property
    def configured(self) -> tuple[str, ...]:
        """The tenants ``--tenant`` names (``*`` aside)."""
        return tuple(name for name in self._specs if name != "*")


def check_name(tenant: str, field: str) -> None:
    """A tenant name from the wire (a header, a peer's ForwardRequest): bounded and printable, else INVALID_ARGUMENT
    naming ``field``."""
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise ServeError(
            ServeCode.INVALID_ARGUMENT, f"{field}: a tenant is at most {MAX_TENANT_CHARS} printable characters", field
        )


class TenantLabels:
    """The label a tenant's series get in /metrics: its name for the configured tenants, ``default`` and the first
    others seen up to MAX_TENANT_LABELS in all; ``other`` beyond (a flood of made-up names cannot grow a scrape)."""

    def __init__(self, configured: tuple[str, ...] = (), limit: int = MAX_TENANT_LABELS) -> None:
        self.limit = limit
        self._labels: dict[str, None] = dict.fromkeys((DEFAULT_TENANT, *configured[: max(limit - 1, 0)]))

    def __call__(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.limit:
            self._labels[tenant] = None
            return tenant
        return OTHER_TENANT_LABEL
