"""The flags of ``p2pnode serve``, group by group (``--help`` shows them in this order)."""

from __future__ import annotations

import argparse
from pathlib import Path

from p2pnode import config as cfg
from p2pnode.cli.args import (
    LOG_LEVELS,
    byte_size,
    fraction,
    host_port,
    http_address,
    log_level,
    lora_module,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    routing_policy,
    tenant_spec,
)
from p2pnode.cost import PROFILES
from p2pnode.gossip import config as gossip_cfg
from p2pnode.routing.policies import SPECS


def add_client_tls(p: argparse.ArgumentParser) -> None:
    """A node serving mTLS (--tls-*) accepts clients with a certificate its CA signed."""
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for a node that runs mTLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="the CA that signed the node's certificate (PEM)")
    p.add_argument("--tls-server-name", help="name to check in the node's certificate (default: the target host)")


def add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a node: engine + gRPC API")
    p.add_argument("--config", type=Path, metavar="FILE.yaml",
                   help="flags from a YAML file (flag: value), as vllm serve --config; flags given here win")
    p.add_argument("--model", type=Path, required=True, help="local model directory")
    p.add_argument("--listen", type=host_port, default="127.0.0.1:50051",
                   help="gRPC address HOST:PORT (port 0 picks a free one)")
    p.add_argument("--node-id", required=True, help="this node's unique id in the mesh")
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm",
                   help="vllm (default) or the simulated engine (tests, demos without vLLM)")
    p.add_argument("--sim-profile", default="instant", choices=("instant", *sorted(PROFILES)),
                   help="the simulated engine's cost profile (instant: every step takes no time)")
    p.add_argument("--sim-kv-blocks", type=positive_int, default=None,
                   help="the simulated engine's KV cache in blocks (default: the profile's capacity)")
    for add in (_engine_flags, _lora_flags, _server_flags, _flow_flags, _routing_flags, _kv_flags, _tier_flags,
                _segment_flags, _mesh_flags, _http_flags, _log_flags):
        add(p)
    return p


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """What the engine is started with (passed to vLLM)."""
    e = p.add_argument_group("engine (passed to vLLM)")
    e.add_argument("--block-size", type=positive_int, default=cfg.DEFAULT_BLOCK_SIZE)
    e.add_argument("--max-model-len", type=positive_int, default=cfg.DEFAULT_MAX_MODEL_LEN)
    e.add_argument("--kv-cache-bytes", type=positive_int, default=cfg.DEFAULT_KV_CACHE_BYTES)
    e.add_argument("--dtype", default=cfg.DEFAULT_DTYPE)
    e.add_argument("--enforce-eager", action="store_true", default=cfg.DEFAULT_ENFORCE_EAGER)
    e.add_argument("--tensor-parallel-size", type=positive_int, default=cfg.DEFAULT_TENSOR_PARALLEL_SIZE)
    e.add_argument("--max-num-seqs", type=positive_int, default=cfg.DEFAULT_MAX_NUM_SEQS)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--engine-nice", type=int, choices=range(0, 20), default=cfg.DEFAULT_ENGINE_NICE,
                   metavar="0-19", help="run the engine's processes this much nicer than the node (0: as the node)")
    e.add_argument("--engine-stall-timeout", type=non_negative_float, default=cfg.DEFAULT_ENGINE_STALL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="an engine with work and no step for this long is stalled: its requests fail retryably and "
                        "the node leaves routing until it steps again (0: never; default "
                        f"{cfg.DEFAULT_ENGINE_STALL_TIMEOUT_S:g})")
    e.add_argument("--gpu-memory-utilization", type=fraction, metavar="FRACTION",
                   help="fraction of GPU memory vLLM may use (CPU: of NUMA node 0's memory); default: vLLM's, "
                        f"and on CPU a {cfg.DEFAULT_CPU_KV_CACHE_BYTES >> 20} MiB KV cache unless --kv-cache-bytes")
    e.add_argument("--eviction-policy", default=cfg.DEFAULT_EVICTION_POLICY,
                   choices=(*cfg.EVICTION_POLICY_NAMES, "adaptive"),
                   help="how the engine picks KV blocks to evict: lru (vLLM's order), s3fifo, sieve, arc, or adaptive "
                        f"(chosen from live traffic by shadow caches; docs/eviction.md); default "
                        f"{cfg.DEFAULT_EVICTION_POLICY}")
    e.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vLLM engine argument, as `vllm serve --KEY VALUE` takes it (repeatable), e.g. "
                        "--engine-arg max_num_batched_tokens=8192")


def _lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA adapters, as vLLM's flags."""
    lo = p.add_argument_group("LoRA adapters (vLLM's flags; docs/lora.md)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    lo.add_argument("--lora-modules", action="append", default=[], type=lora_module, metavar="NAME=PATH",
                    help="an adapter to serve from the start, chosen by requests whose model is NAME (repeatable)")
    lo.add_argument("--max-loras", type=positive_int, default=cfg.DEFAULT_MAX_LORAS,
                    help=f"adapters held in the accelerator at once; default {cfg.DEFAULT_MAX_LORAS}")
    lo.add_argument("--max-lora-rank", type=positive_int, default=cfg.DEFAULT_MAX_LORA_RANK,
                    help=f"the largest adapter rank served; default {cfg.DEFAULT_MAX_LORA_RANK}")
    lo.add_argument("--lora-allowed-dir", action="append", default=[], type=Path, metavar="DIR",
                    help="a directory /v1/load_lora_adapter may load adapters from (repeatable; none: loading at "
                         "run time is off)")


def _server_flags(p: argparse.ArgumentParser) -> None:
    """The node's own limits."""
    s = p.add_argument_group("server limits")
    s.add_argument("--max-in-flight", type=positive_int, default=cfg.DEFAULT_MAX_IN_FLIGHT)
    s.add_argument("--max-message-bytes", type=positive_int, default=cfg.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES)
    s.add_argument("--drain-timeout", type=non_negative_float, default=cfg.DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds SIGTERM waits for in-flight requests")


def _flow_flags(p: argparse.ArgumentParser) -> None:
    """Where requests wait when the engine is full, tenants and their rate limits (docs/flow-control.md)."""
    f = p.add_argument_group("flow control: the queue, tenants, rate limits (docs/flow-control.md)")
    f.add_argument("--max-queue-length", type=non_negative_int, default=cfg.DEFAULT_MAX_QUEUE_LENGTH, metavar="N",
                   help="requests that may wait for the engine beyond --max-in-flight (0: none, a full node refuses); "
                        f"default {cfg.DEFAULT_MAX_QUEUE_LENGTH}")
    f.add_argument("--max-queue-seconds", type=positive_float, default=cfg.DEFAULT_MAX_QUEUE_SECONDS,
                   metavar="SECONDS", help="longest a request waits for the engine before it is shed (503 + "
                   f"Retry-After); default {cfg.DEFAULT_MAX_QUEUE_SECONDS:g}")
    f.add_argument("--tenant", type=tenant_spec, action="append", default=[],
                   metavar="NAME[=KEY][,weight=W][,rps=R][,tps=T][,priority=P]",
                   help="a tenant: the API key that names it (accepted like --api-key), its weight in the queue's "
                        "fair share (default 1), its limits in requests and tokens per second (default unlimited), "
                        "the priority of its requests that name none (vLLM's order, lower first; default 0); "
                        f"NAME {cfg.ANY_TENANT!r}: every tenant without its own (repeatable)")
    f.add_argument("--tenant-header", default="", metavar="NAME",
                   help="a request header (gRPC metadata) naming the tenant of a request whose key names none, e.g. "
                        "x-tenant; set only behind a gateway that sets it (default: none)")
    f.add_argument("--priority-header", default="", metavar="NAME",
                   help="a request header (gRPC metadata) giving the priority (an integer, vLLM's order, lower first) "
                        "of a request whose body names none, over its tenant's, e.g. x-priority; set only behind a "
                        "gateway that sets it (default: none)")


def _routing_flags(p: argparse.ArgumentParser) -> None:
    """How this node routes as an ingress, and watches what it forwards."""
    r = p.add_argument_group("routing")
    r.add_argument("--routing-policy", default=cfg.RoutingConfig.policy, type=routing_policy,
                   help=f"how this node, as an ingress, picks the serving node: {', '.join(SPECS)}, or a what-if of "
                        f"one (p2p@w8: docs/routing.md); default {cfg.RoutingConfig.policy}")
    r.add_argument("--cost-profile", default=cfg.RoutingConfig.cost_profile, choices=sorted(PROFILES),
                   help="engine cost profile the cost-model policies (preble, dualmap) and the plan's shadow replay "
                        f"assume; default {cfg.RoutingConfig.cost_profile}")
    r.add_argument("--max-attempts", type=positive_int, default=cfg.DEFAULT_MAX_ATTEMPTS,
                   help="nodes tried per request before the first token")
    r.add_argument("--migration-limit", type=non_negative_int, default=cfg.DEFAULT_MIGRATION_LIMIT,
                   help="times a stream whose node fails after it sent tokens is continued on another node from "
                        "where it stopped (greedy or unseeded sampling without penalties on the output, structured "
                        f"outputs or segments; 0: never); default {cfg.DEFAULT_MIGRATION_LIMIT}")
    r.add_argument("--plan-period", type=positive_float, default=cfg.RoutingConfig.plan_period_s,
                   help="seconds between rate-plan rebuilds (cacheroute policy)")
    r.add_argument("--no-shadow-gate", action="store_true",
                   help="always apply the plan's affinity instead of gating it behind a shadow replay")
    r.add_argument("--first-token-timeout", type=non_negative_float, default=cfg.DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                   metavar="SECONDS", help="cancel a forwarded request without a first token after this long and "
                   "try the next node (0: no limit)")
    r.add_argument("--peer-keepalive", type=positive_float, default=cfg.DEFAULT_PEER_KEEPALIVE_S, metavar="SECONDS",
                   help="ping a peer serving a forwarded request after this long without traffic; no answer within "
                        f"{cfg.DEFAULT_PEER_KEEPALIVE_TIMEOUT_S:g} s fails the call")
    r.add_argument("--no-peer-links", action="store_true",
                   help="forward each request by a gRPC call of its own instead of over the one stream this node "
                        "keeps to each peer")


def _kv_flags(p: argparse.ArgumentParser) -> None:
    """Moving KV between nodes."""
    k = p.add_argument_group("moving KV between nodes (docs/kv.md)")
    k.add_argument("--kv-link-gbps", type=non_negative_float, default=cfg.DEFAULT_KV_LINK_GBPS, metavar="GBPS",
                   help="the network speed KV pulls are priced with, until measured per peer (0: this node neither "
                        "lends nor pulls KV; needs a mesh); a pull is made when it costs less than computing the "
                        f"prefix or queueing at its holder; default {cfg.DEFAULT_KV_LINK_GBPS:g}")
    k.add_argument("--kv-pull-force", action="store_true",
                   help="price every pull at zero, so the prefix always moves to the chosen node (tests, evidence)")
    k.add_argument("--chaos-kv-block-delay", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="fault injection for tests: this node's engine waits this long after each KV block it lends")


def _tier_flags(p: argparse.ArgumentParser) -> None:
    """The host KV tier under the engine."""
    t = p.add_argument_group("KV tier in host memory under the engine (docs/kv-tier.md)")
    t.add_argument("--host-kv-bytes", type=byte_size, default=cfg.DEFAULT_HOST_KV_BYTES, metavar="BYTES",
                   help="host memory the engine keeps evicted KV blocks in and loads them back from (vLLM's "
                        "offloading; e.g. 64GiB; 0: no tier); refused when above this machine's available memory; "
                        f"default {cfg.DEFAULT_HOST_KV_BYTES}")
    t.add_argument("--tier-store-threshold", type=positive_int, default=cfg.DEFAULT_TIER_STORE_THRESHOLD, metavar="N",
                   help="store a block in the tier once it was offered this many times (1: every block the engine "
                        f"computes; 2: blocks seen twice); default {cfg.DEFAULT_TIER_STORE_THRESHOLD}")
    t.add_argument("--tier-store-outputs", action=argparse.BooleanOptionalAction,
                   default=cfg.DEFAULT_TIER_STORE_OUTPUTS,
                   help="store the blocks of generated outputs too, not only prompts (a conversation's next turn "
                        f"starts with the last answer); default {'on' if cfg.DEFAULT_TIER_STORE_OUTPUTS else 'off'}")
    t.add_argument("--tier-eviction", choices=cfg.TIER_EVICTION_POLICIES, default=cfg.DEFAULT_TIER_EVICTION,
                   help=f"which block a full tier drops (vLLM's policies); default {cfg.DEFAULT_TIER_EVICTION}")
    t.add_argument("--disk-kv-path", default=cfg.DEFAULT_DISK_KV_PATH, metavar="DIR",
                   help="a folder on local disk for a KV tier below the host tier (needs --host-kv-bytes): chunks the "
                        "host tier stores are written there too and loaded back through it, checksummed, and reused "
                        "after a restart of the same KV layout; refused when not writable; default none")
    t.add_argument("--disk-kv-bytes", type=byte_size, default=cfg.DEFAULT_DISK_KV_BYTES, metavar="BYTES",
                   help="the disk tier's bound (least recently used chunks go first); refused when above the free "
                        f"space at --disk-kv-path; default {cfg.DEFAULT_DISK_KV_BYTES >> 30}GiB")


def _segment_flags(p: argparse.ArgumentParser) -> None:
    """Reusing segments beyond prefixes."""
    sg = p.add_argument_group("reusing segments beyond prefixes (docs/segments.md)")
    sg.add_argument("--segment-store-mb", type=non_negative_float, default=cfg.DEFAULT_SEGMENT_STORE_BYTES / 2**20,
                    metavar="MIB", help="host memory of the engine's store of approximate segments (0: none; such "
                    f"requests are then served as plain prompts); default {cfg.DEFAULT_SEGMENT_STORE_BYTES >> 20}")
    sg.add_argument("--segment-policy", choices=cfg.EVICTION_POLICY_NAMES, default=cfg.DEFAULT_SEGMENT_POLICY,
                    help=f"eviction policy of the segment store; default {cfg.DEFAULT_SEGMENT_POLICY}")
    sg.add_argument("--segment-store-threshold", type=positive_int, default=cfg.DEFAULT_SEGMENT_STORE_THRESHOLD,
                    metavar="N", help="store a segment once requests computed it this many times, a peer holding it "
                    "counting as one (1: every segment computed; 2: segments seen twice or held by a peer); default "
                    f"{cfg.DEFAULT_SEGMENT_STORE_THRESHOLD}")
    sg.add_argument("--segment-summary-kb", type=non_negative_float,
                    default=cfg.DEFAULT_SEGMENT_SUMMARY_BYTES / 1024, metavar="KIB",
                    help="gossip at most this much of the store's segment keys (~16 B each), so that peers route to "
                    "and pull from what it holds; every peer keeps ~330 B per key it hears (0: none); default "
                    f"{cfg.DEFAULT_SEGMENT_SUMMARY_BYTES >> 10}")


def _mesh_flags(p: argparse.ArgumentParser) -> None:
    """Joining a mesh (gossip)."""
    g = p.add_argument_group("mesh (gossip); without --cluster-secret-file or --tls-* the node runs standalone")
    g.add_argument("--seeds", default="", help="comma-separated addresses of nodes to join through")
    g.add_argument("--advertise", type=host_port,
                   help="address peers dial (default: the --listen host with the bound port)")
    g.add_argument("--cluster-id", default=gossip_cfg.DEFAULT_CLUSTER_ID)
    g.add_argument("--cluster-secret-file", type=Path, help="file holding the shared cluster secret (>= 16 bytes)")
    g.add_argument("--tls-cert", type=Path, help="this node's certificate (PEM), for mTLS between nodes")
    g.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    g.add_argument("--tls-ca", type=Path, help="the CA that signs every node's certificate (PEM)")
    g.add_argument("--tls-shared-cert", action="store_true",
                   help="let nodes share one certificate: a peer's certificate need not name the --node-id it speaks "
                        "as (by default it must, as its common name or a subject alternative name)")
    g.add_argument("--gossip-profile", choices=tuple(gossip_cfg.PROFILES), default=gossip_cfg.DEFAULT_PROFILE,
                   help="gossip timings for where the mesh runs: lan (1 s rounds), wan (2 s), local (0.2 s: one host, "
                        f"tests and demos); default {gossip_cfg.DEFAULT_PROFILE} (p2pnode/gossip/config.py)")
    g.add_argument("--gossip-interval", type=positive_float, default=None, metavar="SECONDS",
                   help="seconds between gossip rounds (default: the profile's)")
    g.add_argument("--gossip-wire-version", type=int, choices=gossip_cfg.WIRE_VERSIONS,
                   default=gossip_cfg.DEFAULT_WIRE_VERSION,
                   help="the gossip wire version this node starts exchanges in (it reads both and answers in kind): 1 "
                        "while the mesh still runs releases that speak only 1 (upgrade in two rolls: this release "
                        f"with 1, then 2); default {gossip_cfg.DEFAULT_WIRE_VERSION}")
    g.add_argument("--max-members", type=positive_int, default=gossip_cfg.DEFAULT_MAX_MEMBERS,
                   help="most members a node keeps (a bound against floods of made-up members)")
    g.add_argument("--chaos-gossip-loss", type=non_negative_float, default=gossip_cfg.DEFAULT_INJECTED_LOSS,
                   metavar="FRACTION", help="fault injection for tests (scripts/chaos.py): drop this fraction of "
                   "this node's gossip messages")
    g.add_argument("--chaos-gossip-loss-after", type=non_negative_float,
                   default=gossip_cfg.DEFAULT_INJECTED_LOSS_AFTER_S, metavar="SECONDS",
                   help="fault injection for tests: begin --chaos-gossip-loss this long after the node starts")


def _http_flags(p: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP API, API keys, metrics."""
    h = p.add_argument_group("OpenAI-compatible HTTP API, API keys, metrics and logs")
    h.add_argument("--http-listen", type=http_address, metavar="HOST:PORT",
                   help="HTTP address for /v1/*, /metrics, /health, /ready (default: the --listen host, port + "
                        f"{cfg.DEFAULT_HTTP_PORT_OFFSET}; --listen port 0 gives port 0; 'off' disables)")
    h.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model name(s) clients ask for; the first is reported (default: the model directory's name)")
    h.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="render chats with this Jinja template (a file, or the template) instead of the model's, "
                        "as vllm serve --chat-template")
    h.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat with the chat_template its request brings (refused otherwise, as in vllm serve)")
    h.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this Bearer token on the HTTP API and the gRPC client API (repeatable)")
    h.add_argument("--api-key-file", type=Path, help="file of accepted API keys, one per line")
    h.add_argument("--http-header-timeout", type=positive_float, default=cfg.DEFAULT_HTTP_HEADER_TIMEOUT_S,
                   metavar="SECONDS", help="close an HTTP connection (408) whose request header is not all in within "
                   f"this; default {cfg.DEFAULT_HTTP_HEADER_TIMEOUT_S:g}")
    h.add_argument("--http-body-timeout", type=positive_float, default=cfg.DEFAULT_HTTP_BODY_TIMEOUT_S,
                   metavar="SECONDS", help="close an HTTP connection (408) whose request body is not all there within "
                   f"this after its header; default {cfg.DEFAULT_HTTP_BODY_TIMEOUT_S:g}")
    h.add_argument("--http-max-connections-per-client", type=int, metavar="N",
                   default=cfg.DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT,
                   help="open HTTP connections one client address may hold (429 beyond; 0: no cap; raise it behind a "
                        f"load balancer); default {cfg.DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT}")
    h.add_argument("--stats-interval", type=non_negative_float, default=cfg.DEFAULT_STATS_INTERVAL_S,
                   metavar="SECONDS", help="seconds between stats log lines (0: none)")


def _log_flags(p: argparse.ArgumentParser) -> None:
    """Logs."""
    p.add_argument("--log-level", type=log_level, default="INFO", metavar="|".join(LOG_LEVELS))
    p.add_argument("--log-format", choices=cfg.LOG_FORMATS, default=cfg.DEFAULT_LOG_FORMAT,
                   help="text lines, or one JSON object per line")
    p.add_argument("--no-access-log", action="store_true",
                   help="no INFO line per request (the p2pnode.access logger; errors are still logged)")
