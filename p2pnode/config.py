"""Every knob of a p2pnode node and of the simulator, with its default named and explained (hashicorp/memberlist's
config.go is the model): one place to read what a node will do when nothing is set.

The CLI fills these dataclasses; tests and the simulator build them directly, and the simulator derives its own
settings from the node's (``p2pnode.sim.cluster.SimConfig.for_node``). Gossip's knobs are in ``gossip/config.py``.
Nothing else in the package keeps a default of its own: the modules import theirs from here. What stays in the
modules are the parameters of published algorithms (each policy cites its source) and the hard bounds of data
structures and wire formats.

Sections: engine, engine options and lifetime, client API, flow control, routing, forwarding, prefix index and KV
events, KV eviction, rate plan, shadow gate, simulator.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # gossip's package imports modules that import this one
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
#: How long an engine with work may go without a step before the node calls it stalled (seconds; 0: never): it then
#: fails the requests on it (retryable: an ingress moves them), refuses new ones, reports NOT_SERVING and takes its
#: load out of gossip (peers stop routing to it) until the engine steps again (p2pnode/engine/stall.py). vLLM sees a
#: core die, not hang (a stopped process, a stuck driver call or collective). One step must take less: chunked
#: prefill bounds a step to ``max_num_batched_tokens`` (well under a second on a GPU, seconds for a small model on
#: a CPU); vLLM's own bound on a tensor-parallel step is 300 s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS), after which it
#: declares the core dead. 120 s leaves a slow CPU host's longest step room and keeps a hung GPU node out of routing
#: within two minutes instead of for good.
DEFAULT_ENGINE_STALL_TIMEOUT_S = 120.0

# --- engine options, engine lifetime ---------------------------------------------------------------------

#: KV cache of a CPU engine when neither --kv-cache-bytes nor --gpu-memory-utilization is given: 1 GiB. vLLM's CPU
#: backend otherwise reserves gpu_memory_utilization (0.92) of NUMA node 0's whole memory and refuses to start
#: unless that much is free, which fails on any host that runs something else (a 2-node box with ~10 GiB per NUMA
#: node failed with ~1 GiB in use). 1 GiB is 32k blocks of the tiny test model, ~8k tokens of an 8B model in
#: bf16 (128 KiB per token): enough to serve and cache on a shared host; set either flag for more.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
#: AsyncEngineArgs fields ``--engine-arg`` may not set: p2pnode sets them itself (from its own flags, or because
#: the mesh depends on them: prefix caching and KV events are what it routes on).
RESERVED_ENGINE_ARGS = frozenset({
    "model", "enable_prefix_caching", "kv_events_config", "block_size", "max_model_len", "kv_cache_memory_bytes",
    "dtype", "enforce_eager", "tensor_parallel_size", "max_num_seqs", "seed", "gpu_memory_utilization",
    "served_model_name",
    # priority scheduling on every node (ENGINE_SCHEDULING_POLICY)
    "scheduling_policy",
    # vLLM's own KV offloading and connector settings would replace p2pnode's connectors (pulls, segments, the tier)
    "kv_offloading_size", "kv_offloading_backend", "kv_transfer_config",
})
#: vLLM's scheduling on every node: a request's ``priority`` (lower first, as vLLM orders it) takes effect wherever
#: the mesh serves it, and a KV export (one step over cached blocks, ``kv/connector.py``) goes ahead of the queue.
#: Requests of equal priority run in arrival order, as under vLLM's default ``fcfs``.
ENGINE_SCHEDULING_POLICY = "priority"
#: Where a node records its engine's process id (``<dir>/<node id>.engine``), so that a node restarted after being
#: killed finds an engine its previous life left running and says so. Under the system temp dir, per user.
ENGINE_PID_DIR_NAME = "p2pnode-engines"
#: Seconds between two checks, in the engine's process, that the node that started it is still its parent (the
#: kernel's parent-death signal covers Linux at once; this covers the rest and a death during the engine's start).
ENGINE_PARENT_CHECK_S = 1.0

# --- client API -------------------------------------------------------------------------------------------

#: Largest gRPC message a node accepts (bytes). 4 MiB holds a ~1M-token prompt as token ids; larger messages
#: are refused by gRPC with RESOURCE_EXHAUSTED before they reach p2pnode code.
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024
#: Largest message a node sends (a completion chunk is far smaller).
DEFAULT_MAX_SEND_MESSAGE_BYTES = 4 * 1024 * 1024
#: Requests inside one node's engine at once (running, or in vLLM's own queue); beyond it they wait in the node's
#: queue (FlowConfig: bounded in length and time, fair across tenants) instead of in vLLM's first-come-first-served
#: one. Set it near what the engine runs at once (vLLM's max_num_seqs) so that little waits there.
DEFAULT_MAX_IN_FLIGHT = 256
#: Longest prompt text accepted, in characters (checked before tokenizing, which costs CPU).
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
#: Prompt texts longer than this (characters) are tokenized on a worker thread, so the event loop keeps serving.
TOKENIZE_OFF_LOOP_CHARS = 8192
#: Stop strings per request: vLLM's own limit (its ``VLLM_MAX_STOP_STRINGS``, 4 unless set, read the way vLLM reads
#: it), so that the gRPC API, the HTTP API and ``vllm serve`` take the same requests.
MAX_STOP_STRINGS = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))
#: Characters per stop string (p2pnode's bound; vLLM has none).
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
#: How long a launcher waits for a started node's ready line (an engine loads in ~20-40 s on 2 CPU cores, minutes for a
#: large model on a GPU), and for a node it sent SIGTERM to exit (the drain, then the engine's shutdown).
DEFAULT_NODE_START_TIMEOUT_S = 300.0
DEFAULT_NODE_STOP_TIMEOUT_S = 2 * DEFAULT_DRAIN_TIMEOUT_S
#: How long a client waits for a mesh to converge (every node sees every other alive), and how often it asks.
DEFAULT_JOIN_TIMEOUT_S = 60.0
DEFAULT_JOIN_POLL_S = 0.5


@dataclass(frozen=True)
class SamplingDefaults:
    """Values used for sampling fields a request leaves unset (OpenAI's defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Upper bounds (temperature <= 2, penalties in [-2, 2], logprobs <= 20...) are the engine's own: see
    # p2pnode/serving/admission.py check_engine_limits.


# --- LoRA adapters (p2pnode/lora.py; docs/lora.md) ------------------------------------------------------------------

#: Adapters a node serves (started with, plus loaded at run time) and publishes to its peers.
MAX_ADAPTERS = 64
#: Characters of an adapter's name (it is a routing and cache key).
MAX_ADAPTER_NAME_CHARS = 128
#: The longest ``model`` a request may name (a served model name or an adapter's; longer is refused INVALID_ARGUMENT
#: before it is echoed in a NOT_FOUND, or in an access-log line).
MAX_MODEL_NAME_CHARS = 256
#: vLLM's defaults: adapters held in the accelerator's slots at once, and the largest rank served.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
#: What routing charges a node for loading an adapter it likely does not hold (not among its ``max_loras`` most
#: recently used), in prefill tokens of queue: loading a small adapter takes tens of milliseconds, a prefill of ~256
#: tokens on the reference H100 profile. A tie-breaker between nodes that serve the adapter, not a wall.
DEFAULT_ADAPTER_LOAD_TOKENS = 256
#: Characters of a client's cache_salt (it enters every cache key of the request).
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the node's engine (``--enable-lora``...; vLLM's options of the same names)."""

    enabled: bool = False
    #: (name, path) of each adapter served from the start (``--lora-modules NAME=PATH``).
    modules: tuple[tuple[str, Path], ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    #: Directories ``/v1/load_lora_adapter`` may load from (empty: loading at run time is off).
    allowed_dirs: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.allowed_dirs and not self.enabled:  # else every load answered 400 "LoRA is off"
            raise ValueError("--lora-allowed-dir needs --enable-lora")
        if len(self.modules) > MAX_ADAPTERS:
            raise ValueError(f"at most {MAX_ADAPTERS} adapters, got {len(self.modules)}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {sorted(names)}")
        for name in names:
            if not 0 < len(name) <= MAX_ADAPTER_NAME_CHARS or not name.isprintable() or "|" in name:
                raise ValueError(f"adapter name {name!r}: 1-{MAX_ADAPTER_NAME_CHARS} printable characters, no '|'")


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
    stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S
    # --- memory fraction and vLLM pass-through (see "engine options" below) ---
    #: Fraction of accelerator memory vLLM may use (on CPU: of NUMA node 0's memory); None: vLLM's default (0.9),
    #: except that on CPU without it (and without kv_cache_bytes) the KV cache is DEFAULT_CPU_KV_CACHE_BYTES.
    gpu_memory_utilization: float | None = None
    #: Other AsyncEngineArgs fields, by name (``--engine-arg key=value``), already checked against vLLM's fields.
    engine_args: tuple[tuple[str, object], ...] = ()
    #: LoRA adapters (off by default).
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: ``--served-model-name``: vLLM's metrics label the model with the first (as ``vllm serve``'s do).
    served_model_names: tuple[str, ...] = ()
    #: ``--chat-template``: a Jinja template (a file's path, or the template itself) chats are rendered with instead
    #: of the model's own, as in ``vllm serve``; None: the model's.
    chat_template: str | None = None


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

    def __post_init__(self) -> None:
        for flag, value in (("--max-message-bytes", self.max_receive_message_bytes),
                            ("max_send_message_bytes", self.max_send_message_bytes)):
            if not 0 < value < 1 << 31:  # gRPC's limits are 32-bit signed: 2 GiB raised deep in the server's start
                raise ValueError(f"{flag} must be between 1 and {(1 << 31) - 1}, got {value}")


# --- routing ------------------------------------------------------------------------------------------------

#: The policy an ingress routes with (p2pnode/routing/policies/): the longest estimated prefix under a load guard.
DEFAULT_ROUTING_POLICY = "p2p"
#: Nodes an ingress tries for one request before giving up (the target plus retries before the first token).
DEFAULT_MAX_ATTEMPTS = 3
#: Times an ingress continues one sequence on another node after its serving node failed mid-stream
#: (p2pnode/serving/migration.py; 0: never, the client gets the partial output and UNAVAILABLE). One: a failed
#: stream costs its continuation a prefill of the prompt and the tokens sent, which is far cheaper than the client
#: losing the request and sending it again from the start; a second failure of the same request in its lifetime
#: is more likely a request that fails nodes (or a mesh in trouble) than bad luck, and is not worth another.
DEFAULT_MIGRATION_LIMIT = 1
#: How long a routed prefix is assumed cached at its target (seconds): a few gossip intervals, after which the
#: gossiped summary is authoritative (p2pnode/routing/speculative.py).
DEFAULT_SPECULATIVE_TTL_S = 5.0
#: Block hashes the speculative index remembers across all peers (~64 B each in C, ~320 in the Python fallback: ~4 MB
#: at the bound): a bound; what expired is dropped as new sends are recorded, so it holds a TTL's worth of sends
#: below it.
DEFAULT_SPECULATIVE_MAX_ENTRIES = 65_536
#: Leading blocks of the prompt that name a request's routing key when the client gives none: a shared system
#: prompt or document prefix is what should stick together.
DEFAULT_ROUTING_KEY_BLOCKS = 4
#: Longest an ingress goes without re-reading every peer (seconds): between load reports, the info ages and the
#: cached sizes gossip summaries imply drift, and no policy decides on the ages (p2pnode/routing/peer_table.py).
PEER_TABLE_REFRESH_S = 1.0
#: Peer channels kept open by one node (least recently used closed first).
DEFAULT_MAX_PEER_CHANNELS = 256
#: How often the node checks its engine's health and refreshes the load it gossips (seconds).
HEALTH_CHECK_INTERVAL_S = 1.0


# --- rate-limited logs (p2pnode/log_limit.py) --------------------------------------------------------------

#: Lines of one kind (a refusal reason, membership changes...) logged per interval; the rest are counted and the
#: count is logged with the next line of that kind. Five show what is happening; a flood costs five lines a minute.
LOG_LIMIT_BURST = 5
#: The interval of LOG_LIMIT_BURST (seconds).
LOG_LIMIT_INTERVAL_S = 60.0
#: Kinds tracked by one limiter (kinds may come from peers' input); beyond it they share one kind.
LOG_LIMIT_MAX_KINDS = 64

# --- forwarding between nodes: timeouts and keepalive -----------------------------------------------------

#: Longest an ingress waits for a forwarded request's first token before cancelling it there and trying the next
#: node (seconds; 0: no limit). Only forwarded calls: this node knows its own engine is alive. It is the backstop
#: for a peer that is up to gossip and to keepalive pings but does not serve (a stuck engine); frozen and
#: unreachable peers are caught sooner (suspect in ~4 gossip intervals, keepalive below). 30 s is twice the prefill
#: of a 128k-token prompt of an 8B model on one H100 (~10-15 s): a legitimately slow first token is not cut off.
#: A retried request is never duplicated: retries only happen before the first token.
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 30.0
#: A peer channel with a call in flight pings the peer after this many seconds without traffic (gRPC keepalive).
#: Without it a frozen peer (SIGSTOP, a hung host) or a network that silently drops packets holds a forwarded call
#: for as long as TCP retransmits (~15 min); a live peer's gRPC core answers pings on its own threads.
DEFAULT_PEER_KEEPALIVE_S = 10.0
#: ...and closes the channel, failing its calls with UNAVAILABLE, when the ping is not answered within this.
DEFAULT_PEER_KEEPALIVE_TIMEOUT_S = 5.0
#: Forward over one long-lived stream per peer (``Forwarder.Link``, p2pnode/serving/peer_link.py) instead of a gRPC
#: call per request (``--no-peer-links``): a frame on an open stream costs both nodes less CPU and the request less
#: time than a call does (docs/results.md, "The OpenAI-compatible front and forwarding"). Every request keeps its own
#: deadline, cancellation, status and flow control; a peer that serves no links gets a call per request.
DEFAULT_PEER_LINKS = True
#: Response messages a peer may send a request over a link ahead of what this ingress relayed to its client: the
#: most a request buffers here (a slow client holds back its own request, never the link). 32 messages is ~32 tokens,
#: far more than a client behind loopback or a LAN lags by, so a reading client never waits on credit.
DEFAULT_LINK_WINDOW = 32
#: A link with no request open for this long is closed (a peer this node stopped forwarding to costs nothing: no
#: stream, no keepalive pings); the next request opens a new one (seconds).
DEFAULT_LINK_IDLE_S = 60.0
#: Requests one link carries at once, at most: past it the ingress sends a call per request, and a server ends the
#: extra ones RESOURCE_EXHAUSTED (a node's own queue limits are far lower: this only bounds a misbehaving peer).
DEFAULT_MAX_LINK_REQUESTS = 4096
#: A forwarded request whose envelope is larger than this goes by its own call, not a link: a message the peer would
#: refuse as too large (``--max-receive-message-bytes``, 4 MiB) must fail that request alone, not the link.
LINK_MAX_OPEN_BYTES = 1024 * 1024
#: What one link message batches at most before the next (an open larger than it goes alone).
LINK_BATCH_BYTES = 256 * 1024
#: What an ingress holds for a link's writer at most (opens, cancels, credits not yet written): past it, requests go
#: by a call of their own until the link drains. A link whose writes stall (a peer's loop blocked while its transport
#: still answers pings) would otherwise buffer every request sent its way, each envelope up to ``LINK_MAX_OPEN_BYTES``.
LINK_MAX_PENDING_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ForwardingConfig:
    """How an ingress forwards requests and watches them (p2pnode/serving/forward.py, peer_link.py)."""

    first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    keepalive_s: float = DEFAULT_PEER_KEEPALIVE_S
    keepalive_timeout_s: float = DEFAULT_PEER_KEEPALIVE_TIMEOUT_S
    peer_links: bool = DEFAULT_PEER_LINKS
    link_window: int = DEFAULT_LINK_WINDOW
    link_idle_s: float = DEFAULT_LINK_IDLE_S
    max_link_requests: int = DEFAULT_MAX_LINK_REQUESTS

    def __post_init__(self) -> None:
        if self.first_token_timeout_s < 0:
            raise ValueError(f"first_token_timeout_s must be >= 0, got {self.first_token_timeout_s}")
        if not (self.keepalive_s > 0 and self.keepalive_timeout_s > 0):
            raise ValueError("keepalive_s and keepalive_timeout_s must be positive")
        if self.link_window < 2:
            raise ValueError(f"link_window must be >= 2, got {self.link_window}")
        if not self.link_idle_s > 0:
            raise ValueError(f"link_idle_s must be positive, got {self.link_idle_s}")
        if self.max_link_requests < 1:
            raise ValueError(f"max_link_requests must be >= 1, got {self.max_link_requests}")


# --- prefix index and KV events ---------------------------------------------------------------------------

#: Blocks the prefix index holds at most. A safety bound, not a cache policy: the engine's own cache is the real
#: bound and removals keep the index at its size. 262_144 blocks is 4M tokens at block size 16, several times the KV
#: cache an H100 80 GB holds for an 8B model (~0.5M tokens); it only bites when removals were lost, and then costs
#: ~63 MB (prefix_index.BYTES_PER_BLOCK).
DEFAULT_MAX_BLOCKS = 262_144
#: Changes a gossip peer can fall behind by and still catch up incrementally (~3 MB at most); behind that, it gets a
#: full snapshot.
DEFAULT_MAX_JOURNAL = 65_536
#: How long the KV-event subscriber waits for the next replay reply before giving up (seconds). vLLM serves replay
#: requests from its publisher thread between batches (it polls at least every 0.1 s), so a live engine answers well
#: within this.
DEFAULT_REPLAY_TIMEOUT_S = 2.0
#: Live KV-event batches held in memory while a replay is in progress. Matches ZMQ's default receive high-water
#: mark: when full, the subscriber stops reading and lets ZMQ queue (and, past its own limit, drop -> a later gap).
DEFAULT_MAX_PENDING_BATCHES = 1000

# --- KV eviction (p2pnode/cache/eviction/, engine/eviction_hook.py) ----------------------------------------

#: The policy ordering the engine's free blocks (``--eviction-policy``): ``lru`` (vLLM's own order), ``s3fifo``,
#: ``sieve``, ``arc``, or ``adaptive`` (the selector below picks among the candidates from live traffic).
#: ``adaptive`` by default: over the WAKMan mixes it is never more than 0.23 points of hit below the best static
#: policy and at most 0.23 below LRU, and gains up to 6.7 points over LRU where the cache is small next to the working
#: set (docs/results.md, "KV eviction"); it starts on LRU, vLLM's own order, and costs ~140 us of node CPU per
#: request (scripts/bench_eviction.py).
DEFAULT_EVICTION_POLICY = "adaptive"
#: Every static policy a node can run (``--eviction-policy``, and a run-time switch): the engine keeps each one's
#: order of its cached blocks (``switchable.py``), so a switch takes effect at the next eviction with the new
#: policy's history intact.
EVICTION_POLICY_NAMES = ("lru", "s3fifo", "sieve", "arc")
#: vLLM's own order (its free-block queue is LRU): what an engine runs before a node names another, and what the
#: simulator's nodes run by default.
VLLM_EVICTION_POLICY = "lru"
#: What ``adaptive`` chooses among, in order of preference when their recent hit rates tie (LRU first: vLLM's
#: default and the best on recency-heavy traffic). LRU and ARC only: over the 21 WAKMan mixes and ``revisit`` at two
#: cache sizes one of them is the best static policy in every cell (S3-FIFO and SIEVE never are; ARC keeps a re-read
#: set through a scan as they do), and every extra shadow is one more noisy estimate the selector may chase: with all
#: four, brief S3-FIFO leads in the shadows switched nodes to it and cost up to 3.6 points of hit against ARC
#: (docs/eviction.md, "Why two candidates, and the tuning").
EVICTION_CANDIDATES = ("lru", "arc")
#: Most blocks one shadow cache holds. A shadow replays this node's block-access stream at the real capacity; above
#: this capacity the stream is sampled SHARDS-style (requests whose first block hashes below rate * 2^64 are kept,
#: the shadow shrinks by the same rate), so the selector's memory is bounded by candidates x this x ~350 B (a shadow
#: block with its policy's queues and ghosts, measured by scripts/bench_eviction.py: ~11 MB for the 2 candidates)
#: whatever the KV cache size. 16,384 blocks is the
#: whole cache of the simulator's 8B profile at 256-token blocks (1,578) with room to spare, and 256k tokens at
#: vLLM's 16-token blocks.
DEFAULT_SHADOW_MAX_BLOCKS = 16_384
#: Half-life of the shadows' hit rates, in sampled requests: "recent" means the last few hundred requests, long
#: enough that one burst does not decide, short enough to follow a change of traffic within a minute at tens of
#: requests per second per node. Traffic that turns from recency to frequency as a cache fills (agent and chat mixes
#: under pressure) favours short: 150 with one confirmation lowered the worst gap to Belady of 500 with two from 20.70
#: to 20.47 points and the largest shortfall against the best static policy from 0.45 to 0.23 (6 seeds), at ~1.4
#: switches per node per 600 s (docs/eviction.md, "Why two candidates, and the tuning").
DEFAULT_SELECTOR_HALF_LIFE = 150
#: Sampled requests between two decisions (each decision compares the candidates' decayed hit rates).
DEFAULT_SELECTOR_PERIOD = 50
#: Sampled requests before the first decision: the shadows start empty, like the cache, and need to fill first.
DEFAULT_SELECTOR_MIN_REQUESTS = 100
#: Hysteresis: a challenger must beat the active policy's recent hit rate by this much (absolute: 0.005 is half a
#: point of KV hit)...
DEFAULT_SELECTOR_MARGIN = 0.005
#: ...at this many decisions in a row before the node switches (1: the margin alone guards against flapping; a
#: switch moves no block, so a rare needless one costs little).
DEFAULT_SELECTOR_CONFIRM = 1


@dataclass(frozen=True)
class EvictionConfig:
    """Which policy orders the engine's free KV blocks, and how ``adaptive`` chooses (docs/eviction.md)."""

    policy: str = DEFAULT_EVICTION_POLICY
    candidates: tuple[str, ...] = EVICTION_CANDIDATES
    shadow_max_blocks: int = DEFAULT_SHADOW_MAX_BLOCKS
    half_life: int = DEFAULT_SELECTOR_HALF_LIFE
    period: int = DEFAULT_SELECTOR_PERIOD
    min_requests: int = DEFAULT_SELECTOR_MIN_REQUESTS
    margin: float = DEFAULT_SELECTOR_MARGIN
    confirm: int = DEFAULT_SELECTOR_CONFIRM

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("eviction candidates must not be empty")
        if self.policy != "adaptive" and self.policy not in EVICTION_POLICY_NAMES:
            raise ValueError(
                f"eviction policy {self.policy!r} is not one of {', '.join((*EVICTION_POLICY_NAMES, 'adaptive'))}"
            )
        if unknown := [c for c in self.candidates if c not in EVICTION_POLICY_NAMES]:
            raise ValueError(f"eviction candidates {unknown} are not policies ({', '.join(EVICTION_POLICY_NAMES)})")
        if self.shadow_max_blocks < 1 or self.half_life < 1 or self.period < 1 or self.confirm < 1:
            raise ValueError("shadow_max_blocks, half_life, period and confirm must be >= 1")
        if self.min_requests < 0 or self.margin < 0:
            raise ValueError("min_requests and margin must be >= 0")


# --- rate plan (p2pnode/plan/) ------------------------------------------------------------------------------

#: Byte budget of one encoded plan: half a gossip message (64 KiB), so a plan always travels in one message.
#: 128 warm keys on 300 destinations take ~9 KB (``scripts/bench_plan.py``).
DEFAULT_MAX_PLAN_BYTES = 32 * 1024
#: Keys monitored per node. Space-Saving guarantees every key above 1/capacity of the traffic is counted, with an
#: overestimate of at most that much; 2048 is 8x the published top (so the published ranks are accurate on skewed
#: traffic, where the tail's error is far below the bound) for ~0.8 MB per node (``scripts/bench_plan.py``).
DEFAULT_SKETCH_CAPACITY = 2048
#: Half-life of the decay (seconds). Three plan periods (10 s): a rate follows a change within ~a minute, while a
#: key at the warm-set boundary (~0.1-1 req/s) is still averaged over tens of arrivals, so the warm set is stable.
DEFAULT_HALF_LIFE_S = 30.0
#: Shortest observation window the rate estimate divides by (seconds), so a fresh node's first request does not
#: read as a burst of hundreds of requests per second.
DEFAULT_MIN_WINDOW_S = 5.0
#: Keys a node publishes: twice the default warm set (128), so that a key hot in aggregate but spread over many
#: ingresses still appears in enough nodes' tops for the merged rate to rank it.
DEFAULT_PUBLISH_TOP = 256
#: Byte budget of one published summary: a quarter of a gossip message (64 KiB), so it always travels in one
#: message next to the digest and other deltas. 256 keys of ~24 characters take ~11 KB.
DEFAULT_MAX_RATES_BYTES = 16 * 1024
#: Seconds between two plans. Long enough that a plan's pinned prefixes get built and reused (a few hundred
#: requests per destination at typical rates), short enough to follow a shift within ~a rate half-life (30 s).
DEFAULT_PLAN_PERIOD_S = 10.0
#: Warm-set size (CacheRoute's top-K): on a skewed aggregate (Gini ~0.76) the top keys carry most reusable traffic;
#: 128 keys also keep the plan ~10 KB on the wire. Checked in the simulator (docs/results-history.md, "The papers'
#: findings", f): on the 128k-key aggregate at 30 nodes, 512 or 2048 keys (with min_rate 0.02) do not raise the SLO
#: capacity with either fallback and lower p2p-fallback's hit (0.56 -> 0.51 -> 0.45 at 100 QPS); 2048 keys also fill
#: the 32 KiB plan budget (the fit step kept 1,554 keys, 32,765 bytes). Kept at 128.
DEFAULT_TOP_K = 128
#: Relative hysteresis h: an incumbent is evicted only below rank K*(1+h) (or below min_rate/(1+h)); a newcomer
#: displaces an incumbent only with a rate (1+h)x higher; k_b shrinks only at (1-h) of the lower boundary. 25%
#: absorbs the Poisson noise of a key seen ~30 times per half-life (relative sd ~18%).
DEFAULT_HYSTERESIS = 0.25
#: Least merged rate (requests/s) for a key to be worth pinning: a key that does not recur within a plan period
#: gains nothing from a destination of its own. On the simulator's aggregate only ~43 keys pass it at 150 QPS (3.6%
#: of the expected load); admitting down to 0.02 req/s did not help (see DEFAULT_TOP_K). Kept at 0.1.
DEFAULT_MIN_RATE = 0.1
#: q_cap as a multiple of one destination's share of the total expected load (1.0: "one destination's share"). Half
#: a share: a key carrying more than half a destination's load is split, so a whale has pieces on about twice as
#: many destinations and no destination is filled to the mean by single-destination keys alone -- the whale's
#: pieces leave room for ``cacheroute`` to lean its split away from a destination whose small keys ran hot
#: (``routing/policies/cacheroute.py``, ``fill_shares``). At 1.0 the whale's destinations carried it alone and the
#: others only small keys, whose Poisson arrivals nothing could absorb (docs/results-history.md, "The plan's expected
#: loads against what was served": 16 simulated nodes, seeds 0-4, work max/mean 1.10-1.16 at 1.0, 1.03-1.07 at 0.5
#: with the leaning split).
DEFAULT_Q_CAP_FACTOR = 0.5
#: Most destinations of one key (a safety bound; the number of destinations bounds it too). A copy of a prefix is
#: cheap next to the imbalance a capped whale causes (its destinations then run at load/max_kb, above q_cap), so the
#: cap is high: 64 covers a key carrying ~20% of all traffic on a 300-node mesh. Since sum(k_b) <= top_k +
#: destinations / (q_cap_factor * (1 - hysteresis)), the plan's size stays bounded whatever the cap.
DEFAULT_MAX_KB = 64
#: A piece stays on a previous destination while that keeps its warm load within (1 + stickiness) of the mean total
#: load per destination; 10% keeps the balance (test: max/mean <= 1.25) while most keys keep their caches.
DEFAULT_STICKINESS = 0.10
#: Seconds a key that needed k_b >= 2 destinations keeps at least that many while its rate holds (within the
#: hysteresis of its rate then): a whale warming up (its requests turning from misses to hits while the other keys'
#: do too) read as below two shares for a few plans and lost its second destination, then got it back -- at a 2 s
#: plan period it ran on one destination for its first plans. A minute is six default periods (two rate half-lives):
#: long enough to ride out warm-up and Poisson dips, short enough to release a key that really cooled.
DEFAULT_KB_HOLD_S = 60.0
#: Served-work reports kept per member for scoring plans (``plan/served.py``): spaced at least a sixteenth of a plan
#: period apart, 64 span four periods (reports come about once a second while a node serves), ~4 KB per member.
DEFAULT_SERVED_SAMPLES = 64
#: Seconds after a window's end with no newer report from a member before its figures count as unchanged (it served
#: nothing more): it samples every HEALTH_CHECK_INTERVAL_S and gossip delivers within a few rounds.
DEFAULT_SERVED_SETTLE_S = 3.0
#: Seconds of recent served work an ingress weighs each peer's served rate over (``routing/served_rate.py``), the
#: figure ``cacheroute`` leans a whale's split on: long enough to hold a few seconds of Poisson excess to pay back,
#: short enough to forget the warm-up's prefix builds within a minute.
DEFAULT_SERVED_RATE_TAU_S = 20.0
#: Seconds of a peer's reports before its served rate counts (a rate over one report interval is mostly noise).
DEFAULT_SERVED_RATE_MIN_SPAN_S = 5.0
#: Plans kept waiting for their score (the newest first; an older one still unscored is dropped).
DEFAULT_SCORES_PENDING = 4
#: Cost of one uncached prompt token (the unit of load).
DEFAULT_PREFILL_TOKEN_COST = 1.0
#: Cost of one decode token in prefill-token units, when no cost profile says (tests, what-ifs): an 8B model on an
#: H100 prefills ~10k tokens/s and decodes ~2.5k tokens/s per GPU at batch 64, so a decode token costs ~4 prefill
#: tokens of GPU time. A node and the simulator take the ratio of their cost profile (``plan/work.py``).
DEFAULT_DECODE_TOKEN_COST = 4.0


@dataclass(frozen=True)
class PlanConfig:
    """The planner's knobs (p2pnode/plan/planner.py); see the constants above for each default and why."""

    period_s: float = DEFAULT_PLAN_PERIOD_S
    top_k: int = DEFAULT_TOP_K
    hysteresis: float = DEFAULT_HYSTERESIS
    min_rate: float = DEFAULT_MIN_RATE
    q_cap_factor: float = DEFAULT_Q_CAP_FACTOR
    max_kb: int = DEFAULT_MAX_KB
    stickiness: float = DEFAULT_STICKINESS
    kb_hold_s: float = DEFAULT_KB_HOLD_S
    prefill_token_cost: float = DEFAULT_PREFILL_TOKEN_COST
    decode_token_cost: float = DEFAULT_DECODE_TOKEN_COST
    max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")
        if self.top_k < 0 or self.max_kb < 1:
            raise ValueError(f"need top_k >= 0 and max_kb >= 1, got {self.top_k}, {self.max_kb}")
        if not 0 <= self.hysteresis < 1 or self.stickiness < 0:
            raise ValueError(f"need 0 <= hysteresis < 1 and stickiness >= 0, got {self.hysteresis}, {self.stickiness}")
        if self.min_rate < 0 or not self.q_cap_factor > 0:
            raise ValueError(f"need min_rate >= 0 and q_cap_factor > 0, got {self.min_rate}, {self.q_cap_factor}")
        if self.prefill_token_cost < 0 or self.decode_token_cost < 0:
            raise ValueError("token costs must be >= 0")
        if self.kb_hold_s < 0:
            raise ValueError(f"kb_hold_s must be >= 0, got {self.kb_hold_s}")


#: Engine cost profile (p2pnode/cost/profiles.py) routing's cost models and the simulator assume:
#: Llama-3.1-8B, BF16, on one H100 (the ratios that matter are much the same across GPUs and model sizes).
DEFAULT_COST_PROFILE = "llama-3.1-8b-h100"


# --- moving KV between nodes (p2pnode/kv/, routing/links.py) -----------------------------------------------------

#: The network figure a KV pull is priced with, in Gb/s, until pulls from a peer are measured (0: never pull). What a
#: node's NIC sustains to its peers for a gRPC stream (10 on a 10 GbE LAN; 100 and 400 Gb/s need RDMA, which gRPC over
#: TCP is not). Off by default: on a CPU host recomputing a prefix is cheaper than moving it.
DEFAULT_KV_LINK_GBPS = 0.0
#: Weight of each measured pull in its holder's link figure (an exponentially weighted mean).
KV_LINK_EWMA_WEIGHT = 0.2
#: Pulls smaller than this say nothing about the link (the round trip dominates): not measured.
KV_LINK_MIN_MEASURED_BYTES = 1 << 20
#: How long a holder keeps blocks leased for a puller (seconds) before releasing them unpulled: a pull starts
#: milliseconds after its lease is granted, so this only bounds what a puller that died can hold.
DEFAULT_KV_LEASE_TTL_S = 10.0
#: Longest a pull's transfer may take before the puller gives up and computes what did not arrive (seconds).
DEFAULT_KV_FETCH_TIMEOUT_S = 30.0
#: Longest a holder's export (its engine leasing the blocks, one engine step) may take before the puller computes.
DEFAULT_KV_EXPORT_TIMEOUT_S = 5.0
#: Exports a holder grants at once, and blocks it keeps leased at once (beyond them: RESOURCE_EXHAUSTED, the puller
#: computes): leased blocks are not free for the holder's own requests, so the bound keeps lending from starving it.
DEFAULT_KV_MAX_EXPORTS = 8
DEFAULT_KV_MAX_LEASED_BLOCKS = 4096
#: Pulls a holder engine's block server streams at once (each a thread in its worker process).
DEFAULT_KV_MAX_STREAMS = 8


@dataclass(frozen=True)
class KvPullConfig:
    """Moving KV between nodes (p2pnode/kv/): on when ``RoutingConfig.kv_link_gbps`` > 0 (the node then lends its
    blocks and pulls its peers')."""

    lease_ttl_s: float = DEFAULT_KV_LEASE_TTL_S
    fetch_timeout_s: float = DEFAULT_KV_FETCH_TIMEOUT_S
    export_timeout_s: float = DEFAULT_KV_EXPORT_TIMEOUT_S
    max_exports: int = DEFAULT_KV_MAX_EXPORTS
    max_leased_blocks: int = DEFAULT_KV_MAX_LEASED_BLOCKS
    max_streams: int = DEFAULT_KV_MAX_STREAMS
    #: Fault injection (tests, scripts/chaos.py): seconds the block server waits after each block it sends, so a pull
    #: lasts long enough to kill its holder mid-way. 0 everywhere else.
    block_delay_s: float = 0.0


# --- the host KV tier under the engine (p2pnode/kv/tier/; docs/kv-tier.md) -------------------------------------------

#: Host memory of the engine's KV tier, in bytes (0: no tier). Off by default everywhere: the tier holds real memory
#: from the engine's start, and how much a host can spare beside its other work is the operator's to say (a GPU server
#: has ~256 GB of host memory per GPU, several times the GPU's KV; a shared CPU host has far less).
DEFAULT_HOST_KV_BYTES = 0
#: How many times a block must be offered before the tier stores it (vLLM's ``store_threshold``; 1: every block the
#: engine computes). A one-off prompt's blocks stored at once push older blocks out of the tier; seen twice, a block has
#: shown it is reused, at the cost of a miss on its second use.
DEFAULT_TIER_STORE_THRESHOLD = 1
#: Store the blocks of a request's output too, not only its prompt (vLLM's ``offload_prompt_only`` is the opposite and
#: defaults to prompts only): a conversation's next turn starts with the last answer, which only the output's blocks
#: hold.
DEFAULT_TIER_STORE_OUTPUTS = True
#: Which block the tier drops when it is full (vLLM's cache policies).
DEFAULT_TIER_EVICTION = "lru"
TIER_EVICTION_POLICIES = ("lru", "arc")
#: The disk tier below the host tier: its folder ("": no disk tier). Off by default: it writes to a disk the operator
#: chooses. Each engine layout keeps its entries in a folder of its own under it (docs/kv-tier.md).
DEFAULT_DISK_KV_PATH = ""
#: The disk tier's bound, in bytes (entries and their 128-byte headers); least recently used entries go first. 16 GiB
#: holds ~128k tokens of an 8B model (128 KiB per token, bf16). Refused at start when above the path's free space.
DEFAULT_DISK_KV_BYTES = 16 << 30
#: Prefix chains whose namespace (LoRA adapter, cache salt) the node remembers from their engine life: vLLM's
#: host-tier events carry no cache salt, so a tier block is indexed only when its chain's first block was seen in the
#: engine's own events (~120 B each; oldest forgotten first -- a forgotten chain's tier copy is not indexed).
TIER_NAMESPACE_CHAINS = 65_536


@dataclass(frozen=True)
class TierConfig:
    """The host KV tier under the node's engine (``--host-kv-bytes`` and its knobs)."""

    host_bytes: int = DEFAULT_HOST_KV_BYTES
    store_threshold: int = DEFAULT_TIER_STORE_THRESHOLD
    store_outputs: bool = DEFAULT_TIER_STORE_OUTPUTS
    eviction: str = DEFAULT_TIER_EVICTION
    #: The disk tier below it (``--disk-kv-path``, ``--disk-kv-bytes``; "": none).
    disk_path: str = DEFAULT_DISK_KV_PATH
    disk_bytes: int = DEFAULT_DISK_KV_BYTES

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"host KV tier bytes must be >= 0, got {self.host_bytes}")
        if self.store_threshold < 1:
            raise ValueError(f"tier store threshold must be >= 1, got {self.store_threshold}")
        if self.eviction not in TIER_EVICTION_POLICIES:
            raise ValueError(f"tier eviction {self.eviction!r} is not one of {', '.join(TIER_EVICTION_POLICIES)}")
        if self.disk_path:
            if self.disk_bytes <= 0:
                raise ValueError(f"--disk-kv-bytes must be > 0, got {self.disk_bytes}")
            if self.host_bytes <= 0:
                raise ValueError("--disk-kv-path needs --host-kv-bytes: the disk tier is filled from the host tier")
            if self.store_threshold != 1:
                # vLLM's tiering manager refuses an admission threshold (v1/kv_offload/tiering/spec.py)
                raise ValueError("--disk-kv-path needs --tier-store-threshold 1: vLLM's tiers below the host tier "
                                 "take no admission threshold")

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_path)

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


# --- reuse of segments beyond prefixes (p2pnode/cache/segments.py, p2pnode/kv/segments.py; docs/segments.md) -----

#: Host memory of an engine's segment store (approximate reuse), in bytes. Approximate segments are opt-in per
#: request and the store holds only what such requests computed, so an unused store costs nothing. 1 GiB holds ~1M
#: tokens of the tiny test model and ~8k of an 8B model (128 KiB per token): size it to the documents you reuse.
DEFAULT_SEGMENT_STORE_BYTES = 1 << 30
#: The store's eviction policy (a static one of ``EVICTION_POLICY_NAMES``). S3-FIFO: a segment enters a small FIFO
#: and reaches the main queue only when it is reused there, so the one-off documents of a Zipfian retrieval pass
#: through without pushing out the reused ones -- admission by evidence of reuse at no second computation. Over LRU, in
#: the simulator (approximate, docs/segments.md "Admission"): one node 0.405 -> 0.483 on ``rag`` and +0.005 to +0.039
#: on ``ragpulse-shaped``; 16 nodes +0.03 on ``rag``, the same on ``ragpulse-shaped``.
DEFAULT_SEGMENT_POLICY = "s3fifo"
#: How many times requests must compute a segment before the store keeps it (as the KV tier's
#: ``DEFAULT_TIER_STORE_THRESHOLD``; 1: every segment computed). At 2, pieces named as segments that never repeat (a
#: conversation's history, a document retrieved once) do not push reused documents out, at the cost of a document's
#: second computation: one node gains (rag 18.2x -> 20.6x prefix caching; ragpulse-shaped +0.014 at 200k and 404k
#: tokens), but a mesh loses -- a document must be computed twice on the same node, and routing spreads a request's
#: documents -- (ragpulse-shaped, 16 nodes, p2p: 0.569 -> 0.540 KV hit, 0.647 -> 0.586 with segment pulls at 100 Gb/s;
#: docs/segments.md, "Admission"). So 1.
DEFAULT_SEGMENT_STORE_THRESHOLD = 1
#: Segments one request may name: each is searched in the prompt, and exact mode tries orders of the cached ones.
MAX_SEGMENTS = 64
#: First tokens of each segment approximate mode may be asked to compute (``segment_recompute_tokens``).
MAX_SEGMENT_RECOMPUTE_TOKENS = 256
#: Segment keys a node counts for exact-mode ordering (``cache/segments.FrequencySketch``).
SEGMENT_SKETCH_KEYS = 65536
#: Bytes of the hot segment keys a node gossips (``cache/segment_summary.py``: the keys its engine's store holds,
#: newest first, ~16 B each on the wire: 4,096 keys), half the block summary's own bound (8,192 hashes); like it, a
#: peer's full reset spans a few gossip messages. A store whose keys do not all fit hides the rest from routing and
#: pulls: at RAGPulse's 255-token passages 4,096 keys are ~1M tokens (an 8B model's store of ~128 GiB of host memory);
#: 8 KiB (512 keys) hid most of a 16-node mesh's stores and cost it 0.04-0.06 of KV hit (docs/segments.md). A peer
#: holds what every peer publishes: ~330 B per key (gossip state and view), ~1.3 MB per peer publishing all 4,096 --
#: ~85 MB on a 64-node mesh of full stores; lower it (``--segment-summary-kb``) on meshes of hundreds.
DEFAULT_SEGMENT_SUMMARY_BYTES = 64 * 1024
#: The most ``--segment-summary-kb`` may be: 16,384 keys of 16 B (``cache/segment_summary.SEGMENT_ENTRY_BYTES``), a
#: quarter of what a peer holds of one member (``GossipConfig.max_node_keys``, 65,536), room left for its prefix
#: summaries and tombstones. Past that bound every peer refused every update of the node as oversized, its load and
#: summary going stale for good while its heartbeat still said it was alive.
MAX_SEGMENT_SUMMARY_BYTES = 256 * 1024
#: Orders of a request's segments the router tries at most when it estimates what an exact-mode layout would reuse
#: on every node at once (``routing/segments.py``): each hashes one more segment's blocks and probes every peer's
#: summary once. 32 covers the first level of any request (``MAX_SEGMENTS`` is 64 only for the bound's sake; a RAG
#: prompt names 3-6) and a few levels deeper where some node holds a chain.
MAX_ROUTE_LAYOUT_PROBES = 32


@dataclass(frozen=True)
class SegmentConfig:
    """Reusing segments that are not a prefix (docs/segments.md)."""

    #: 0 turns the store off: approximate requests are then served as plain prompts (their final message says so).
    store_bytes: int = DEFAULT_SEGMENT_STORE_BYTES
    policy: str = DEFAULT_SEGMENT_POLICY
    #: Offers a computed segment needs before the store keeps it (``--segment-store-threshold``).
    store_threshold: int = DEFAULT_SEGMENT_STORE_THRESHOLD
    #: Re-rotate a loaded segment's keys to its new positions. Off only to measure what skipping it costs
    #: (scripts/segment_divergence.py): keys left at their old positions make attention see them elsewhere.
    rotate: bool = True
    #: Bytes of the hot segment keys this node gossips (0: none).
    summary_bytes: int = DEFAULT_SEGMENT_SUMMARY_BYTES

    def __post_init__(self) -> None:
        if self.store_bytes < 0:
            raise ValueError(f"segment store bytes must be >= 0, got {self.store_bytes}")
        if not 0 <= self.summary_bytes <= MAX_SEGMENT_SUMMARY_BYTES:
            raise ValueError(
                f"segment summary bytes must be in [0, {MAX_SEGMENT_SUMMARY_BYTES}] (--segment-summary-kb at most "
                f"{MAX_SEGMENT_SUMMARY_BYTES // 1024}), got {self.summary_bytes}"
            )
        if self.store_threshold < 1:
            raise ValueError(f"segment store threshold must be >= 1, got {self.store_threshold}")
        if self.policy not in EVICTION_POLICY_NAMES:
            raise ValueError(f"segment policy {self.policy!r} is not one of {', '.join(EVICTION_POLICY_NAMES)}")


@dataclass(frozen=True)
class RoutingConfig:
    """How an ingress chooses the node that serves a request (p2pnode/routing/)."""

    #: A name from p2pnode.routing.policies (p2p, flat, sticky, chwbl, sglang, dynamo, dualmap, preble, cacheroute),
    #: optionally with what-if parameters (``p2p@w8``: ``PolicySpec.variant``).
    policy: str = DEFAULT_ROUTING_POLICY
    #: The engine cost profile whose speed the cost-model policies (preble, dualmap) and the shadow gate's replay
    #: assume (p2pnode/cost/profiles.py); the simulator runs a node of the same profile identically.
    cost_profile: str = DEFAULT_COST_PROFILE
    #: Link figure KV pulls are priced with (Gb/s; 0: no pulls). ``p2p`` weighs a pull against a prefill there.
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS
    #: Price every pull at zero (tests and evidence: on a CPU host a prefill is always cheaper than a transfer).
    kv_pull_force: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    #: Continuations of a sequence whose node failed after it streamed tokens (``DEFAULT_MIGRATION_LIMIT``).
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    routing_key_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS
    #: How often the rate plan is rebuilt and rates are published.
    plan_period_s: float = DEFAULT_PLAN_PERIOD_S
    #: Gate the plan's affinity behind a shadow replay of recent traffic (p2pnode/plan/gate.py). Off: the plan's
    #: warm keys always go to their destinations.
    shadow_gate: bool = True

    def __post_init__(self) -> None:
        if not math.isfinite(self.speculative_ttl_s):  # the speculative index takes a finite TTL (<= 0: none)
            ttl = self.speculative_ttl_s
            raise ValueError(f"routing speculative_ttl_s must be a finite number of seconds, got {ttl}")


# --- shadow gate (p2pnode/plan/gate.py) ---------------------------------------------------------------------

#: Requests remembered for replay (oldest dropped first); ~150 B + 8 B per block each.
DEFAULT_LOG_MAX_REQUESTS = 2048
#: Leading blocks of a request kept in the log (enough to see shared prefixes; longer prompts are truncated).
DEFAULT_LOG_MAX_BLOCKS = 256
#: Fewer logged requests than this: too little evidence, keep the previous decision.
DEFAULT_MIN_REQUESTS = 200
#: Affinity must predict at least this much more token-weighted KV hit than cache-blind balancing...
DEFAULT_MIN_HIT_GAIN = 0.05
#: ...to be switched on; once on, it stays on while the gain is at least this fraction of that (hysteresis: a
#: replay of a short log, e.g. a new planner's first, underestimates the gain -- its caches start cold -- and a
#: verdict that flips on sampling noise would switch every router's affinity off and on).
DEFAULT_KEEP_GAIN_FRACTION = 0.5
#: ...and a p99 TTFT no more than this fraction above it...
DEFAULT_P99_TOLERANCE = 0.10
#: ...or no more than this many seconds above it: a replay's p99 of a few ms moves by more than 10% on noise (a
#: short log's p99 is its second-slowest request), and no SLO is decided by it.
DEFAULT_P99_SLACK_S = 0.05
#: Seconds between replays (each costs ~1-2 s of one core at the default log size).
DEFAULT_GATE_PERIOD_S = 60.0
#: Simulator cost profile used for the replay when the node names none (its ``RoutingConfig.cost_profile``).
DEFAULT_GATE_PROFILE = DEFAULT_COST_PROFILE
# --- OpenAI-compatible HTTP API, API keys, metrics and logs -----------------------------------------------

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
#: Deepest nesting of arrays and objects a JSON body may have; deeper ones get 400 naming the bound. Python's JSON
#: parser recurses once per level and fails near 1,000 (a RecursionError answered 500 with two tracebacks); real
#: bodies nest a few levels (a chat message's content parts: 5), a JSON schema a few more.
DEFAULT_HTTP_MAX_JSON_DEPTH = 64
#: A connection must deliver a request's whole header within this (seconds from its first byte, or from the
#: connection's opening); a client that does not (slowloris) gets 408 and is closed. Go's http.Server and nginx
#: use similar bounds; a real client sends its headers in one packet.
DEFAULT_HTTP_HEADER_TIMEOUT_S = 10.0
#: A request's whole body must arrive within this after its header (seconds), else the connection is closed
#: (408): at least 2.2 Mb/s for an 8 MiB body, far less than any network a node serves on. Without it a client
#: trickling a body holds a connection (and its request) for ever.
DEFAULT_HTTP_BODY_TIMEOUT_S = 30.0
#: Open HTTP connections one client address may hold; beyond it a new connection gets 429 and is closed at once
#: (0: no cap), so that one client cannot take the server's whole DEFAULT_HTTP_MAX_CONNECTIONS. A load balancer
#: in front of a node shares one address among its clients: raise it there.
DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT = 256
#: Access lines of refused calls (bad input, unknown model, wrong key, overload) written per kind of refusal (its
#: status code) per LOG_LIMIT_INTERVAL_S; the others are counted in p2pnode:rejected_requests_total{api, code} and
#: the next line of that kind says how many were held back. A client sending garbage in a loop cannot fill the
#: disk; every successful or failed call still gets its own line.
ACCESS_LOG_REJECTED_BURST = 5
#: Seconds between the node's stats log lines (0: none); vLLM logs its engine line on the same clock.
DEFAULT_STATS_INTERVAL_S = 10.0
#: Log lines as text, or one JSON object per line ("json", python-json-logger; the engine's processes too).
DEFAULT_LOG_FORMAT = "text"
LOG_FORMATS = ("text", "json")
#: Under --log-format json, output that bypasses logging (native code, progress bars, child processes) is wrapped
#: line by line (json_stdio.py); a line longer than this is cut into pieces of this size, each its own JSON object.
DEFAULT_JSON_STDIO_MAX_LINE_BYTES = 65536


@dataclass(frozen=True)
class ClientApiConfig:
    """The client-facing APIs beyond gRPC's listen address: the HTTP server, model names, keys, stats."""

    #: HOST:PORT of the OpenAI-compatible HTTP API; None: derived from the gRPC address (see the offset); "": off.
    http_listen: str | None = None
    http_max_request_bytes: int = DEFAULT_HTTP_MAX_REQUEST_BYTES
    http_max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS
    http_keep_alive_s: float = DEFAULT_HTTP_KEEP_ALIVE_S
    http_max_json_depth: int = DEFAULT_HTTP_MAX_JSON_DEPTH
    http_header_timeout_s: float = DEFAULT_HTTP_HEADER_TIMEOUT_S
    http_body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S
    http_max_connections_per_client: int = DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT
    #: Names clients may ask for (HTTP ``model``, gRPC ``model``); empty: the model directory's name.
    served_model_names: tuple[str, ...] = ()
    #: Bearer tokens accepted on the HTTP API (``Authorization``) and the gRPC client API (``authorization``
    #: metadata); empty: no authentication. Peer RPCs are authenticated by the cluster secret or mTLS instead.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    #: Render chats with a template the request brings (``chat_template``); off, such requests are refused, as in
    #: ``vllm serve`` (a template is code the server runs).
    trust_request_chat_template: bool = False


# --- flow control: the node's queue, tenants, rate limits (p2pnode/serving/engine_queue.py; docs/flow-control.md) --

#: Requests that may wait for the engine at once, beyond the max_in_flight inside it (0: none wait -- a full node
#: refuses at once, as before the queue). A waiting request costs a few hundred bytes and its prompt; 1024 is four
#: engines' worth of the default max_in_flight, which at a typical few seconds per request is well past the wait
#: anyone is let to do (DEFAULT_MAX_QUEUE_SECONDS): the length bounds memory under a flood, the seconds bound latency.
DEFAULT_MAX_QUEUE_LENGTH = 1024
#: Longest a request waits in the queue before it is shed (seconds; a client's own deadline cuts it shorter). Half
#: the first-token timeout (DEFAULT_FIRST_TOKEN_TIMEOUT_S): a forwarded request that waited its longest at its
#: server still has time for a long prefill before its ingress gives up on the first token.
DEFAULT_MAX_QUEUE_SECONDS = 15.0
#: The tenant of a request that names none (no tenant key, no tenant header).
DEFAULT_TENANT = "default"
#: ``--tenant *,...``: the spec of every tenant not named by its own ``--tenant``.
ANY_TENANT = "*"
#: Longest tenant name (a header's value is client input: longer ones are refused).
MAX_TENANT_CHARS = 64
#: Tenants that get their own label in /metrics (configured ones first, then the first seen); the rest count under
#: "other", so a flood of made-up header values cannot grow the scrape.
MAX_TENANT_LABELS = 32
#: The label value of tenants beyond MAX_TENANT_LABELS.
OTHER_TENANT_LABEL = "other"


@dataclass(frozen=True)
class TenantSpec:
    """One ``--tenant``: a name, the API key that names it (optional: a header may name it instead), its weight in
    the queue's fair share, its rate limits (0: unlimited) and the priority its requests get when they name none
    (vLLM's order, lower first; 0, the default, changes nothing)."""

    name: str
    key: str = field(default="", repr=False)
    weight: float = 1.0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_TENANT_CHARS or not self.name.isprintable():
            raise ValueError(f"tenant name must be 1..{MAX_TENANT_CHARS} printable characters, got {self.name!r}")
        if self.key and self.name == ANY_TENANT:
            raise ValueError(f"tenant {ANY_TENANT!r} (every other tenant) cannot have a key")
        if not 0 < self.weight < float("inf"):
            raise ValueError(f"tenant {self.name!r}: weight must be a finite number > 0, got {self.weight}")
        for name in ("requests_per_s", "tokens_per_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"tenant {self.name!r}: {name} must be a finite number >= 0, got {value}")
        if not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"tenant {self.name!r}: priority must be a 32-bit integer, got {self.priority}")


@dataclass(frozen=True)
class FlowConfig:
    """Where a request waits when the engine is full, who it belongs to, and how fast each tenant may send."""

    max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH
    max_queue_seconds: float = DEFAULT_MAX_QUEUE_SECONDS
    #: A request header (gRPC metadata) naming the tenant of a request whose key names none; "": none read. Set it
    #: only behind a gateway that sets it: a client may write any value there.
    tenant_header: str = ""
    #: A request header (gRPC metadata) giving the priority (vLLM's order, an integer, lower first) of a request
    #: whose body names none (or 0); it wins over its tenant's ``priority``. "": none read. Set it only behind a
    #: gateway that sets it, as the tenant header.
    priority_header: str = ""
    tenants: tuple[TenantSpec, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.max_queue_length < 0:
            raise ValueError(f"max queue length must be >= 0, got {self.max_queue_length}")
        if not self.max_queue_seconds > 0:
            raise ValueError(f"max queue seconds must be > 0, got {self.max_queue_seconds}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"a tenant is named twice: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
        keys = [t.key for t in self.tenants if t.key]
        if len(set(keys)) != len(keys):
            raise ValueError("two tenants have the same key")

    def spec_of(self, tenant: str) -> TenantSpec:
        """The tenant's own spec, else ``*``'s, else an unlimited one of weight 1."""
        named = {t.name: t for t in self.tenants}
        spec = named.get(tenant) or named.get(ANY_TENANT)
        return spec if spec is not None else TenantSpec(tenant)


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
    #: First-token timeout and keepalive of forwarded calls.
    forwarding: ForwardingConfig = field(default_factory=ForwardingConfig)
    #: The engine's KV eviction policy and adaptive's selector.
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    #: KV pulls between nodes (on when ``routing.kv_link_gbps`` > 0).
    kv: KvPullConfig = field(default_factory=KvPullConfig)
    #: The segment store of approximate reuse.
    segments: SegmentConfig = field(default_factory=SegmentConfig)
    #: The host KV tier under the engine.
    tier: TierConfig = field(default_factory=TierConfig)
    #: The queue in front of the engine, tenants and their rate limits.
    flow: FlowConfig = field(default_factory=FlowConfig)

    @property
    def kv_setup(self) -> KvSetup:
        """What KV this node's engine moves and keeps (``KvSetup``): pulls need a mesh to pull over (gossip) and a
        link figure to price them with (``routing.kv_link_gbps`` > 0)."""
        pulls = self.routing.kv_link_gbps > 0 and self.gossip is not None
        host = (self.advertise or self.server.listen).rsplit(":", 1)[0] if pulls else ""
        return KvSetup(self.kv if pulls else None, host, self.segments, self.tier)


@dataclass(frozen=True)
class KvSetup:
    """What KV a node's engine moves and keeps beside its own cache, decided once from the node's configuration
    (``NodeConfig.kv_setup``): the CLI, the engine and the node read this, never the flags behind it."""

    #: Pulls between nodes: this node lends its cached blocks and pulls its peers' (None: it moves no KV).
    pulls: KvPullConfig | None = None
    #: The host its engine's block server listens on (the address peers dial, without the port); "" without pulls.
    block_server_host: str = ""
    #: The segment store of approximate reuse (``store_bytes`` 0: none).
    segments: SegmentConfig = field(default_factory=SegmentConfig)
    #: The host KV tier (``host_bytes`` 0: none).
    tier: TierConfig = field(default_factory=TierConfig)

    @property
    def connector(self) -> bool:
        """Whether the engine runs p2pnode's KV connector (``p2pnode/kv/connector.py``): pulls, a segment store, or a
        host tier (which runs beside it: ``kv/settings.py``)."""
        return self.pulls is not None or self.segments.store_bytes > 0 or self.tier.enabled


# --- simulator (p2pnode/sim/) -----------------------------------------------------------------------------------
# A simulated run takes every routing, gossip and plan setting from the node's defaults above; these are its own.

#: Engine cost profile of a simulated node: the node's (``DEFAULT_COST_PROFILE``).
DEFAULT_SIM_PROFILE = DEFAULT_COST_PROFILE
#: Block size of a simulated run when the workload states none (each workload states its own preference:
#: ``Workload.block_size``). Not the node's 32: a block is the unit of caching, hashing and matching, and the
#: simulator's cost is per block; a coarser block loses up to block_size - 1 reusable tokens per shared-prefix
#: boundary. On the aggregate, 128 instead of 256 raises p2p's hit rate by ~2.5% (0.432 vs 0.422 over 1M requests)
#: and costs 1.75x the time. Mooncake traces come in 512-token blocks.
DEFAULT_SIM_BLOCK_SIZE = 256
#: Nodes of a simulated mesh.
DEFAULT_SIM_NODES = 16
#: Arrivals of the papers' workloads when Gamma is asked for: coefficient of variation 1.9, the burstiness CacheRoute
#: measured on its aggregate trace (1 is Poisson).
DEFAULT_ARRIVAL_CV = 1.9
#: Block size of the Mooncake-format traces (their hash_ids name 512-token blocks) and of the production shapes
#: built from Mooncake's published statistics.
MOONCAKE_BLOCK_SIZE = 512
#: KV eviction of a simulated node: vLLM's own LRU, not the node's ``adaptive`` default, so that routing results
#: compare with the papers' (which ran vLLM as it ships); ``--eviction adaptive`` runs the node's selector.
DEFAULT_SIM_EVICTION = VLLM_EVICTION_POLICY
#: One network hop between nodes (gRPC on a LAN; forwarding adds ~1.2 ms p50 on loopback: docs/results.md).
DEFAULT_FORWARD_LATENCY_S = 0.001
#: The TTFT SLO SLO capacity is judged against (p99, seconds): CacheRoute's 3.5 s.
DEFAULT_SIM_SLO_P99_TTFT_S = 3.5
#: Seconds of arrivals per simulated run.
DEFAULT_SIM_DURATION_S = 120.0
#: The workload ``p2pnode sim`` runs when none is named.
DEFAULT_SIM_WORKLOAD = "cacheroute-aggregate"
#: How a simulated request reuses its segments when the run names no mode (``--segments``): prefix caching only.
DEFAULT_SIM_SEGMENTS = "none"
#: Share of a simulated node's KV capacity given to its segment store in ``approximate`` runs (the rest stays the
#: paged prefix cache, which also holds the running requests): every mode then holds the same tokens of KV per node,
#: so hit rates compare at equal capacity. Three quarters: an approximate node's paged cache reuses only prefix chains
#: (a shared system prompt) and holds the running batch, so the documents earn the rest -- over a half, ``rag`` +0.037
#: of KV hit on one node and +0.035 / +0.042 on 16 (without / with pulls), ``ragpulse-shaped`` -0.006 to +0.01, the
#: same SLO capacity on ``rag``'s 16 nodes (docs/segments.md "Admission"). A real node's store is host memory beside
#: the GPU's cache, not a share of it.
DEFAULT_SIM_SEGMENT_STORE_SHARE = 0.75
#: How a simulated node's KV tiers store unless told otherwise (``engine/simulated/tiers.py``): every block offered
#: (vLLM's ``store_threshold`` 1), outputs with prompts (a conversation's next turn starts with the last answer), LRU
#: (vLLM's default). Chosen by measurement: docs/simulator.md, "KV tiers".
DEFAULT_SIM_TIER_STORE_THRESHOLD = 1
DEFAULT_SIM_TIER_PROMPT_ONLY = False
DEFAULT_SIM_TIER_EVICTION = "lru"
#: A simulated node's admission queue (``sim/admission.py``, when the run has flow control): how long a request may
#: wait there before it is shed (answered unserved), and how many may wait -- a node's own defaults.
DEFAULT_SIM_MAX_QUEUE_S = DEFAULT_MAX_QUEUE_SECONDS
DEFAULT_SIM_MAX_QUEUE_LENGTH = DEFAULT_MAX_QUEUE_LENGTH
