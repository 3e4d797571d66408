"""Every knob of a p2pnode node, with its default named and explained (hashicorp/memberlist's config.go is the
model): one place to read what a node will do when nothing is set.

The CLI fills these dataclasses; tests and the simulator build them directly. Nothing else in the package keeps
a literal default of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2pnode.gossip.config import GossipConfig

# --- engine -------------------------------------------------------------------------------------------------

#: Tokens per KV block. The CPU backend needs a multiple of 32 (16 fails there); p2pnode hashes blocks of the
#: same size, so every node of a mesh must use one value.
DEFAULT_BLOCK_SIZE = 32
#: Longest prompt + completion the engine accepts; None keeps the model's own limit.
DEFAULT_MAX_MODEL_LEN: int | None = None
#: KV cache size in bytes; None lets vLLM size it (GPU: from gpu_memory_utilization; CPU: VLLM_CPU_KVCACHE_SPACE).
#: Setting it on CPU also skips vLLM's memory profiling, which makes the engine start faster.
DEFAULT_KV_CACHE_BYTES: int | None = None
#: Model weights' dtype as vLLM understands it ("auto", "bfloat16", "float16", "float32").
DEFAULT_DTYPE = "auto"
#: Skip CUDA graph / torch.compile warm-up: faster start, slower decode. Off on GPUs, on for the CPU demo.
DEFAULT_ENFORCE_EAGER = False
#: GPUs one engine spans.
DEFAULT_TENSOR_PARALLEL_SIZE = 1
#: Engine-side limit on concurrently scheduled sequences; None keeps vLLM's default.
DEFAULT_MAX_NUM_SEQS: int | None = None
#: Batches the KV-event publisher keeps for replay after a gap (vLLM's own default is 10_000).
DEFAULT_KV_EVENTS_BUFFER_STEPS = 10_000
#: How much lower the engine's processes run than the node itself (nice increment; 0 leaves them alone). Under
#: CPU contention a node slower than its engine stops answering RPCs and gossip until the engine goes quiet
#: (p2pnode/engine/priority.py); on an uncontended host nice values change nothing.
DEFAULT_ENGINE_NICE = 10

# --- client API -------------------------------------------------------------------------------------------

#: Largest gRPC message a node accepts (bytes). 4 MiB holds a ~1M-token prompt as token ids; larger messages
#: are refused by gRPC with RESOURCE_EXHAUSTED before they reach p2pnode code.
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024
#: Largest message a node sends (a completion chunk is far smaller).
DEFAULT_MAX_SEND_MESSAGE_BYTES = 4 * 1024 * 1024
#: Generate calls served at once by one node's engine; beyond it new calls get RESOURCE_EXHAUSTED instead of
#: queueing without bound.
DEFAULT_MAX_IN_FLIGHT = 256
#: Longest prompt text accepted, in characters (checked before tokenizing, which costs CPU).
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
#: Stop strings per request and characters per stop string.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
#: Longest client-supplied request id / routing key / end-user id (OpenAI's ``user``).
MAX_REQUEST_ID_CHARS = 128
MAX_ROUTING_KEY_CHARS = 256
MAX_USER_CHARS = 256
#: Sequences one call may ask for (``n``, times the prompts of an HTTP completion): each is routed and served as
#: its own request and counts against max_in_flight.
MAX_N = 128
#: How long SIGTERM waits for in-flight requests before cancelling them (seconds).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SamplingDefaults:
    """Values used for sampling fields a request leaves unset (OpenAI's defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Upper bounds (temperature <= 2, penalties in [-2, 2], logprobs <= 20...) are the engine's own: see
    # p2pnode/api/validation.py check_engine_limits.


@dataclass(frozen=True)
class EngineConfig:
    """How the node starts its engine (passed through to vLLM's AsyncEngineArgs)."""

    model: Path
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    dtype: str = DEFAULT_DTYPE
    enforce_eager: bool = DEFAULT_ENFORCE_EAGER
    tensor_parallel_size: int = DEFAULT_TENSOR_PARALLEL_SIZE
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS
    kv_events_buffer_steps: int = DEFAULT_KV_EVENTS_BUFFER_STEPS
    seed: int = 0
    engine_nice: int = DEFAULT_ENGINE_NICE


@dataclass(frozen=True)
class ServerConfig:
    """The client-facing gRPC server."""

    listen: str = "127.0.0.1:50051"
    max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES
    max_send_message_bytes: int = DEFAULT_MAX_SEND_MESSAGE_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)


#: Nodes an ingress tries for one request before giving up (the target plus retries before the first token).
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class RoutingConfig:
    """How an ingress chooses the node that serves a request (p2pnode/routing/)."""

    #: A name from p2pnode.routing.policies (p2p, flat, sticky, chwbl, sglang, dynamo, dualmap, preble).
    policy: str = "p2p"
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    #: See p2pnode/routing/speculative.py and router.py for these two.
    speculative_ttl_s: float = 5.0
    routing_key_blocks: int = 4
    #: How often the rate plan is rebuilt and rates are published (p2pnode/routing/planner.py's default: 10 s).
    plan_period_s: float = 10.0
    #: Gate the plan's affinity behind a shadow replay of recent traffic (p2pnode/routing/gate.py). Off: the plan's
    #: warm keys always go to their destinations.
    shadow_gate: bool = True


# --- OpenAI-compatible HTTP API, API keys, metrics and logs (issue 11) --------------------------------------

#: Unless --http-listen says otherwise, the HTTP API listens on the gRPC --listen host at the gRPC port + this
#: offset (gRPC 50051 -> HTTP 51051): nodes sharing a host with distinct --listen ports get distinct HTTP ports
#: with no extra flag, and --listen HOST:0 gives HTTP HOST:0 (a free port; the ready line prints both).
DEFAULT_HTTP_PORT_OFFSET = 1000
#: Largest HTTP request body (bytes); larger ones get 413. JSON token ids take ~6 bytes each, so 8 MiB holds
#: the prompts the gRPC API's 4 MiB message limit holds.
DEFAULT_HTTP_MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: Open HTTP connections and requests at once (uvicorn's limit_concurrency); beyond it new ones get 503.
DEFAULT_HTTP_MAX_CONNECTIONS = 2048
#: Idle keep-alive HTTP connections are closed after this long (seconds; vLLM's default too).
DEFAULT_HTTP_KEEP_ALIVE_S = 5.0
#: Seconds between the node's stats log lines (0: none); vLLM logs its engine line on the same clock.
DEFAULT_STATS_INTERVAL_S = 10.0
#: Log lines as text, or one JSON object per line ("json", python-json-logger; the engine's processes too).
DEFAULT_LOG_FORMAT = "text"
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ClientApiConfig:
    """The client-facing APIs beyond gRPC's listen address: the HTTP server, model names, keys, stats."""

    #: HOST:PORT of the OpenAI-compatible HTTP API; None: derived from the gRPC address (see the offset); "": off.
    http_listen: str | None = None
    http_max_request_bytes: int = DEFAULT_HTTP_MAX_REQUEST_BYTES
    http_max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS
    http_keep_alive_s: float = DEFAULT_HTTP_KEEP_ALIVE_S
    #: Names clients may ask for (HTTP ``model``, gRPC ``model``); empty: the model directory's name.
    served_model_names: tuple[str, ...] = ()
    #: Bearer tokens accepted on the HTTP API (``Authorization``) and the gRPC client API (``authorization``
    #: metadata); empty: no authentication. Peer RPCs are authenticated by the cluster secret or mTLS instead.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S


def derived_http_listen(grpc_listen: str) -> str:
    """The default HTTP address for a gRPC listen address (same host, port + DEFAULT_HTTP_PORT_OFFSET)."""
    host, _, port_text = grpc_listen.rpartition(":")
    port = int(port_text)
    if port == 0:
        return f"{host}:0"
    if port + DEFAULT_HTTP_PORT_OFFSET > 65535:
        raise ValueError(f"gRPC port {port} + {DEFAULT_HTTP_PORT_OFFSET} is not a port: set --http-listen")
    return f"{host}:{port + DEFAULT_HTTP_PORT_OFFSET}"


@dataclass(frozen=True)
class NodeConfig:
    """One node: who it is, what it serves, where it listens."""

    node_id: str
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    #: Gossip settings; None runs a standalone node (no peers, no forwarding).
    gossip: GossipConfig | None = None
    #: Addresses of nodes to join through (any one live seed is enough).
    seeds: tuple[str, ...] = ()
    #: Address peers and clients should dial when it differs from --listen (e.g. listening on 0.0.0.0).
    advertise: str | None = None
    #: Directory for the node's ipc sockets (KV events); a private temp dir when None.
    run_dir: Path | None = None
    #: HTTP API, served model names, API keys, stats interval.
    api: ClientApiConfig = field(default_factory=ClientApiConfig)
