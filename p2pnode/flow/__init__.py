"""Flow control: where a request waits when its node is full, in what order, and when it is turned away.

- ``queue``: the node's waiting requests, strict priority between priorities and start-time fair queueing across
  tenants within one, over token work (pure: the caller's clock; the node and the simulator run the same code);
- ``rate_limit``: per-tenant token buckets (requests and tokens per second), which also drain by what the rest of
  the mesh admitted for the tenant, so a limit holds mesh-wide.
"""
