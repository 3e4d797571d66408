"""Tenants and priorities over any workload: who sends each request, and how urgent it is.

``TenantMix`` wraps a workload and tags its requests as they come, leaving everything else as the workload made it
(arrivals, prompts, outputs, the same requests for the same seed):
- ``tenant``: drawn by the tenants' rate ``share``s, once per session -- a conversation's turns and an agent's steps
  belong to one tenant (a session is the workload's stream, ``SimRequest.session``; a request of no stream, a trace's,
  is its own session). Each tenant's ``weight`` is its fair share's weight in the nodes' admission queues
  (``sim/admission.py``; ``tenant_weights`` gives them to ``SimConfig``);
- ``priority``: ``HIGH_PRIORITY`` for a ``high_priority_frac`` of requests, drawn per request, else 0 (vLLM's
  default; lower runs first).
Draws are hashes of (seed, session) and (seed, request id), so a tenant's requests are the same whatever the other
tenants send: ``only`` keeps one tenant's requests and drops the rest, the run in which that tenant alone sends its
own requests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.base import Limit, Workload, cumulative, pick

__all__ = ["HIGH_PRIORITY", "Tenant", "TenantMix", "parse_tenants"]

#: The priority a high-priority request is sent with (vLLM: lower runs first; 0 is the default).
HIGH_PRIORITY = -1
_U64 = float(1 << 64)


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, its share of the sessions sent, its fair share's weight."""

    name: str
    share: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if self.share <= 0 or self.weight <= 0:
            raise ValueError(f"tenant {self.name}: share and weight must be > 0, got {self.share}, {self.weight}")


def parse_tenants(text: str) -> tuple[Tenant, ...]:
    """``NAME:SHARE[:WEIGHT],...`` (``polite:1,greedy:4`` or ``a:1:2,b:1:1``); ValueError when malformed."""
    tenants = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"tenant {item!r}: expected NAME:SHARE or NAME:SHARE:WEIGHT")
        try:
            tenants.append(Tenant(parts[0], float(parts[1]), float(parts[2]) if len(parts) == 3 else 1.0))
        except ValueError as e:
            raise ValueError(f"tenant {item!r}: {e}") from None
    if not tenants:
        raise ValueError(f"no tenant in {text!r}")
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError(f"a tenant is named twice in {text!r}")
    return tuple(tenants)


def _uniform(seed: int, salt: int, key: int) -> float:
    return (xxhash.xxh3_64_intdigest(key.to_bytes(16, "little", signed=True), (seed << 8) ^ salt) + 0.5) / _U64


def _session(r: SimRequest) -> int:
    """The stream ``r`` continues, or -1 - its id when it is none's (a trace's request)."""
    return r.session if r.session >= 0 else -1 - r.rid


class TenantMix:
    """``inner``'s requests, tagged with tenants and priorities (module docstring)."""

    def __init__(
        self,
        inner: Workload,
        tenants: Sequence[Tenant] = (),
        high_priority_frac: float = 0.0,
        only: str | None = None,
    ) -> None:
        if not 0 <= high_priority_frac <= 1:
            raise ValueError(f"high_priority_frac must be in [0, 1], got {high_priority_frac}")
        if only is not None and only not in {t.name for t in tenants}:
            raise ValueError(f"only: no tenant {only!r}")
        self.inner = inner
        self.tenants = tuple(tenants)
        self.high_priority_frac = high_priority_frac
        self.only = only
        self.name = inner.name
        self.block_size = inner.block_size
        self.description = inner.description
        self._cum = cumulative([t.share for t in self.tenants]) if self.tenants else []

    def __getattr__(self, name: str) -> object:
        """What else ``inner`` says of itself (a trace's ``records``, ``native_qps``, ``has_segments``): a mix replays
        the same requests, so a trace's rate, length and segments are the mix's."""
        if name == "inner" or name.startswith("__"):  # while unpickling (``--jobs``), before ``inner`` is set
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def tenant_weights(self) -> tuple[tuple[str, float], ...]:
        """(tenant, weight) pairs, for ``SimConfig.tenant_weights``."""
        return tuple((t.name, t.weight) for t in self.tenants)

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        for head in self.inner.requests(qps, seed, space, limit):
            tenant = ""
            if self.tenants:
                tenant = self.tenants[pick(_uniform(seed, 1, _session(head)), self._cum)].name
                if self.only is not None and tenant != self.only:
                    continue
            r: SimRequest | None = head
            while r is not None:
                if self.tenants:  # else the workload's own (a trace's)
                    r.tenant = tenant
                if self.high_priority_frac and _uniform(seed, 2, r.rid) < self.high_priority_frac:
                    r.priority = HIGH_PRIORITY
                r = r.follow
            yield head
