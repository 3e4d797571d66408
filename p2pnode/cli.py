"""``p2pnode`` command line: serve | generate | status | sim."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from p2pnode import config as cfg
from p2pnode.cost import PROFILES
from p2pnode.gossip import config as gossip_cfg
from p2pnode.routing.policies import SPECS, get_spec


def _routing_policy(text: str) -> str:
    """A registered policy, or a what-if of one (``p2p@w8``): ``get_spec`` says why not."""
    try:
        get_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --- argument types and one-line errors ---------------------------------------------------------------------------

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag (the usage of ``serve`` is dozens of lines)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: type[float] | type[int], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float, "a positive number of seconds")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _number(text, float, "a fraction in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _host_port(text: str) -> str:
    from p2pnode.api.listen import BadAddress, split_host_port

    try:
        split_host_port(text)
    except BadAddress as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def _http_address(text: str) -> str:
    return text if text.strip().lower() in ("off", "none", "") else _host_port(text)


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _token_ids(text: str) -> list[int]:
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise argparse.ArgumentTypeError(f"expected comma-separated token ids (integers >= 0), got {part!r}")
        ids.append(int(part))
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _add_client_tls(p: argparse.ArgumentParser) -> None:
    """A node serving mTLS (--tls-*) accepts clients with a certificate its CA signed."""
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for a node that runs mTLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="the CA that signed the node's certificate (PEM)")
    p.add_argument("--tls-server-name", help="name to check in the node's certificate (default: the target host)")


def _add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a node: engine + gRPC API")
    p.add_argument("--config", type=Path, metavar="FILE.yaml",
                   help="flags from a YAML file (flag: value), as vllm serve --config; flags given here win")
    p.add_argument("--model", type=Path, required=True, help="local model directory")
    p.add_argument("--listen", type=_host_port, default="127.0.0.1:50051",
                   help="gRPC address HOST:PORT (port 0 picks a free one)")
    p.add_argument("--node-id", required=True, help="this node's unique id in the mesh")
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm",
                   help="vllm (default) or the simulated engine (tests, demos without vLLM)")
    p.add_argument("--sim-profile", default="instant", choices=("instant", *sorted(PROFILES)),
                   help="the simulated engine's cost profile (instant: every step takes no time)")
    p.add_argument("--sim-kv-blocks", type=_positive_int, default=None,
                   help="the simulated engine's KV cache in blocks (default: the profile's capacity)")
    e = p.add_argument_group("engine (passed to vLLM)")
    e.add_argument("--block-size", type=_positive_int, default=cfg.DEFAULT_BLOCK_SIZE)
    e.add_argument("--max-model-len", type=_positive_int, default=cfg.DEFAULT_MAX_MODEL_LEN)
    e.add_argument("--kv-cache-bytes", type=_positive_int, default=cfg.DEFAULT_KV_CACHE_BYTES)
    e.add_argument("--dtype", default=cfg.DEFAULT_DTYPE)
    e.add_argument("--enforce-eager", action="store_true", default=cfg.DEFAULT_ENFORCE_EAGER)
    e.add_argument("--tensor-parallel-size", type=_positive_int, default=cfg.DEFAULT_TENSOR_PARALLEL_SIZE)
    e.add_argument("--max-num-seqs", type=_positive_int, default=cfg.DEFAULT_MAX_NUM_SEQS)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--engine-nice", type=int, choices=range(0, 20), default=cfg.DEFAULT_ENGINE_NICE,
                   metavar="0-19", help="run the engine's processes this much nicer than the node (0: as the node)")
    e.add_argument("--gpu-memory-utilization", type=_fraction, metavar="FRACTION",
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
    lo = p.add_argument_group("LoRA adapters (vLLM's flags; docs/lora.md)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    lo.add_argument("--lora-modules", action="append", default=[], type=_lora_module, metavar="NAME=PATH",
                    help="an adapter to serve from the start, chosen by requests whose model is NAME (repeatable)")
    lo.add_argument("--max-loras", type=_positive_int, default=cfg.DEFAULT_MAX_LORAS,
                    help=f"adapters held in the accelerator at once; default {cfg.DEFAULT_MAX_LORAS}")
    lo.add_argument("--max-lora-rank", type=_positive_int, default=cfg.DEFAULT_MAX_LORA_RANK,
                    help=f"the largest adapter rank served; default {cfg.DEFAULT_MAX_LORA_RANK}")
    lo.add_argument("--lora-allowed-dir", action="append", default=[], type=Path, metavar="DIR",
                    help="a directory /v1/load_lora_adapter may load adapters from (repeatable; none: loading at "
                         "run time is off)")
    s = p.add_argument_group("server limits")
    s.add_argument("--max-in-flight", type=_positive_int, default=cfg.DEFAULT_MAX_IN_FLIGHT)
    s.add_argument("--max-message-bytes", type=_positive_int, default=cfg.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES)
    s.add_argument("--drain-timeout", type=_non_negative_float, default=cfg.DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds SIGTERM waits for in-flight requests")
    r = p.add_argument_group("routing")
    r.add_argument("--routing-policy", default=cfg.RoutingConfig.policy, type=_routing_policy,
                   help=f"how this node, as an ingress, picks the serving node: {', '.join(SPECS)}, or a what-if of "
                        f"one (p2p@w8: docs/routing.md); default {cfg.RoutingConfig.policy}")
    r.add_argument("--cost-profile", default=cfg.RoutingConfig.cost_profile, choices=sorted(PROFILES),
                   help="engine cost profile the cost-model policies (preble, dualmap) and the plan's shadow replay "
                        f"assume; default {cfg.RoutingConfig.cost_profile}")
    r.add_argument("--max-attempts", type=_positive_int, default=cfg.DEFAULT_MAX_ATTEMPTS,
                   help="nodes tried per request before the first token")
    r.add_argument("--plan-period", type=_positive_float, default=cfg.RoutingConfig.plan_period_s,
                   help="seconds between rate-plan rebuilds (cacheroute policy)")
    r.add_argument("--no-shadow-gate", action="store_true",
                   help="always apply the plan's affinity instead of gating it behind a shadow replay")
    k = p.add_argument_group("moving KV between nodes (docs/kv.md)")
    k.add_argument("--kv-link-gbps", type=_non_negative_float, default=cfg.DEFAULT_KV_LINK_GBPS, metavar="GBPS",
                   help="the network speed KV pulls are priced with, until measured per peer (0: this node neither "
                        "lends nor pulls KV; needs a mesh); a pull is made when it costs less than computing the "
                        f"prefix or queueing at its holder; default {cfg.DEFAULT_KV_LINK_GBPS:g}")
    k.add_argument("--kv-pull-force", action="store_true",
                   help="price every pull at zero, so the prefix always moves to the chosen node (tests, evidence)")
    k.add_argument("--chaos-kv-block-delay", type=_non_negative_float, default=0.0, metavar="SECONDS",
                   help="fault injection for tests: this node's engine waits this long after each KV block it lends")
    sg = p.add_argument_group("reusing segments beyond prefixes (docs/segments.md)")
    sg.add_argument("--segment-store-mb", type=_non_negative_float, default=cfg.DEFAULT_SEGMENT_STORE_BYTES / 2**20,
                    metavar="MIB", help="host memory of the engine's store of approximate segments (0: none; such "
                    f"requests are then served as plain prompts); default {cfg.DEFAULT_SEGMENT_STORE_BYTES >> 20}")
    sg.add_argument("--segment-policy", choices=cfg.EVICTION_POLICY_NAMES, default=cfg.DEFAULT_SEGMENT_POLICY,
                    help=f"eviction policy of the segment store; default {cfg.DEFAULT_SEGMENT_POLICY}")
    r.add_argument("--first-token-timeout", type=_non_negative_float, default=cfg.DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                   metavar="SECONDS", help="cancel a forwarded request without a first token after this long and "
                   "try the next node (0: no limit)")
    r.add_argument("--peer-keepalive", type=_positive_float, default=cfg.DEFAULT_PEER_KEEPALIVE_S, metavar="SECONDS",
                   help="ping a peer serving a forwarded request after this long without traffic; no answer within "
                        f"{cfg.DEFAULT_PEER_KEEPALIVE_TIMEOUT_S:g} s fails the call")
    g = p.add_argument_group("mesh (gossip); without --cluster-secret-file or --tls-* the node runs standalone")
    g.add_argument("--seeds", default="", help="comma-separated addresses of nodes to join through")
    g.add_argument("--advertise", type=_host_port,
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
    g.add_argument("--gossip-interval", type=_positive_float, default=None, metavar="SECONDS",
                   help="seconds between gossip rounds (default: the profile's)")
    g.add_argument("--max-members", type=_positive_int, default=gossip_cfg.DEFAULT_MAX_MEMBERS,
                   help="most members a node keeps (a bound against floods of made-up members)")
    g.add_argument("--chaos-gossip-loss", type=_non_negative_float, default=gossip_cfg.DEFAULT_INJECTED_LOSS,
                   metavar="FRACTION", help="fault injection for tests (scripts/chaos.py): drop this fraction of "
                   "this node's gossip messages")
    h = p.add_argument_group("OpenAI-compatible HTTP API, API keys, metrics and logs")
    h.add_argument("--http-listen", type=_http_address, metavar="HOST:PORT",
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
    h.add_argument("--http-header-timeout", type=_positive_float, default=cfg.DEFAULT_HTTP_HEADER_TIMEOUT_S,
                   metavar="SECONDS", help="close an HTTP connection (408) whose request header is not all in within "
                   f"this; default {cfg.DEFAULT_HTTP_HEADER_TIMEOUT_S:g}")
    h.add_argument("--http-body-timeout", type=_positive_float, default=cfg.DEFAULT_HTTP_BODY_TIMEOUT_S,
                   metavar="SECONDS", help="close an HTTP connection (408) whose request body is not all there within "
                   f"this after its header; default {cfg.DEFAULT_HTTP_BODY_TIMEOUT_S:g}")
    h.add_argument("--http-max-connections-per-client", type=int, metavar="N",
                   default=cfg.DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT,
                   help="open HTTP connections one client address may hold (429 beyond; 0: no cap; raise it behind a "
                        f"load balancer); default {cfg.DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT}")
    h.add_argument("--stats-interval", type=_non_negative_float, default=cfg.DEFAULT_STATS_INTERVAL_S,
                   metavar="SECONDS", help="seconds between stats log lines (0: none)")
    p.add_argument("--log-level", type=_log_level, default="INFO", metavar="|".join(LOG_LEVELS))
    p.add_argument("--log-format", choices=cfg.LOG_FORMATS, default=cfg.DEFAULT_LOG_FORMAT,
                   help="text lines, or one JSON object per line")
    p.add_argument("--no-access-log", action="store_true",
                   help="no INFO line per request (the p2pnode.access logger; errors are still logged)")
    return p


def _gossip_config(args: argparse.Namespace) -> gossip_cfg.GossipConfig | None:
    """The gossip settings from the flags, or None for a standalone node."""
    tls_flags = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_flags) and not all(tls_flags):
        raise SystemExit("p2pnode serve: --tls-cert, --tls-key and --tls-ca go together")
    secret = None
    if args.cluster_secret_file is not None:
        try:
            secret = args.cluster_secret_file.read_bytes().strip()
        except OSError as e:
            raise SystemExit(f"p2pnode serve: --cluster-secret-file: {e}") from e
        if len(secret) < 16:
            raise SystemExit("p2pnode serve: --cluster-secret-file: the secret must be at least 16 bytes")
    tls = (
        gossip_cfg.TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, bind_node_id=not args.tls_shared_cert)
        if all(tls_flags) else None
    )
    if secret is None and tls is None:
        if args.seeds:
            raise SystemExit("p2pnode serve: --seeds needs --cluster-secret-file or --tls-cert/--tls-key/--tls-ca")
        return None
    if args.max_members < 2:
        raise SystemExit("p2pnode serve: --max-members must be at least 2")
    if args.chaos_gossip_loss >= 1:
        raise SystemExit("p2pnode serve: --chaos-gossip-loss must be below 1")
    interval = {} if args.gossip_interval is None else {"interval_s": args.gossip_interval}
    return gossip_cfg.GossipConfig.profile(
        args.gossip_profile,
        cluster_id=args.cluster_id,
        cluster_secret=secret,
        tls=tls,
        max_members=args.max_members,
        injected_loss=args.chaos_gossip_loss,
        **interval,
    )


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k for k in args.api_key if k]
    if args.api_key_file is not None:
        try:
            keys += [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise SystemExit(f"p2pnode serve: --api-key-file: {e}") from e
        if not keys:
            raise SystemExit("p2pnode serve: --api-key-file: no key in the file")
    return tuple(keys)


def _http_listen(args: argparse.Namespace) -> str | None:
    if args.http_listen is None:
        try:
            cfg.derived_http_listen(args.listen)
        except ValueError as e:
            raise SystemExit(f"p2pnode serve: {e}") from e
        return None
    if args.http_listen.lower() in ("off", "none", ""):
        return ""
    return args.http_listen


def _add_client_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=os.environ.get("P2PNODE_API_KEY"),
                   help="API key of the node (default: $P2PNODE_API_KEY)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="send one Generate call and print the result")
    p.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    p.add_argument("--target", type=_host_port, default="127.0.0.1:50051", help="any node's address")
    p.add_argument("--token-ids", type=_token_ids, help="comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id", default="")
    p.add_argument("--routing-key", default="")
    p.add_argument("--model", help="a served model name or a LoRA adapter (default: the base model)")
    p.add_argument("--cache-salt", help="keep this request's KV apart from requests without the same salt")
    p.add_argument("--segment", action="append", default=[], metavar="TEXT",
                   help="a reusable part of the prompt (repeatable, in prompt order; docs/segments.md)")
    p.add_argument("--segment-reuse", choices=("exact", "approximate"),
                   help="how to reuse the --segment texts beyond prefix caching")
    p.add_argument("--timeout", type=_positive_float, default=120.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_client_auth(p)
    _add_client_tls(p)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a node's status")
    p.add_argument("--target", type=_host_port, default="127.0.0.1:50051")
    p.add_argument("--timeout", type=_positive_float, default=10.0)
    p.add_argument("--json", action="store_true")
    _add_client_auth(p)
    _add_client_tls(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2pnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.serve_parser = _add_serve(sub)  # type: ignore[attr-defined]  # --config reads its flags
    _add_generate(sub)
    _add_status(sub)
    from p2pnode.sim.cli import add_sim_parser

    add_sim_parser(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from p2pnode import json_stdio, logs

    if args.log_format == "json":  # before anything writes or starts: every line from here to exit is JSON
        json_stdio.install(cfg.DEFAULT_JSON_STDIO_MAX_LINE_BYTES)
        logging.captureWarnings(True)  # a Python warning is one record, not a message line and a source line
    logs.configure(args.log_level, args.log_format, access_log=not args.no_access_log)
    engine_config = cfg.EngineConfig(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        engine_nice=args.engine_nice,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine_args=_engine_args(args),
        lora=_lora_config(args),
        served_model_names=tuple(args.served_model_name or ()) or (args.model.name,),
        chat_template=args.chat_template,
    )
    node_config = cfg.NodeConfig(
        node_id=args.node_id,
        engine=engine_config,
        server=cfg.ServerConfig(
            listen=args.listen,
            max_receive_message_bytes=args.max_message_bytes,
            max_in_flight=args.max_in_flight,
            drain_timeout_s=args.drain_timeout,
        ),
        routing=cfg.RoutingConfig(
            policy=args.routing_policy,
            cost_profile=args.cost_profile,
            max_attempts=args.max_attempts,
            plan_period_s=args.plan_period,
            shadow_gate=not args.no_shadow_gate,
            kv_link_gbps=args.kv_link_gbps,
            kv_pull_force=args.kv_pull_force,
        ),
        gossip=_gossip_config(args),
        seeds=tuple(s.strip() for s in args.seeds.split(",") if s.strip()),
        advertise=args.advertise,
        api=cfg.ClientApiConfig(
            http_listen=_http_listen(args),
            served_model_names=tuple(args.served_model_name or ()),
            api_keys=_api_keys(args),
            stats_interval_s=args.stats_interval,
            http_header_timeout_s=args.http_header_timeout,
            http_body_timeout_s=args.http_body_timeout,
            http_max_connections_per_client=max(args.http_max_connections_per_client, 0),
            trust_request_chat_template=args.trust_request_chat_template,
        ),
        forwarding=cfg.ForwardingConfig(
            first_token_timeout_s=args.first_token_timeout, keepalive_s=args.peer_keepalive
        ),
        eviction=cfg.EvictionConfig(policy=args.eviction_policy),
        kv=cfg.KvPullConfig(block_delay_s=args.chaos_kv_block_delay),
        segments=cfg.SegmentConfig(store_bytes=int(args.segment_store_mb * 2**20), policy=args.segment_policy),
    )
    if args.kv_pull_force and not node_config.kv_pulls:
        raise SystemExit("p2pnode serve: --kv-pull-force needs --kv-link-gbps above 0 and a mesh (a cluster secret)")
    if args.engine == "vllm":
        if not args.model.is_dir():
            print(f"p2pnode serve: --model {args.model} is not a directory", file=sys.stderr)
            return 2
        from p2pnode.engine.vllm_engine import VllmEngine

        kv_host = (args.advertise or args.listen).rsplit(":", 1)[0] if node_config.kv_pulls else None
        engine = VllmEngine(
            engine_config, node_id=args.node_id, kv_host=kv_host, kv=node_config.kv, segments=node_config.segments
        )
    else:
        from p2pnode.engine.simulated.realtime import SIM_MAX_MODEL_LEN, SimEngine

        engine = SimEngine(
            block_size=args.block_size,
            num_blocks=args.sim_kv_blocks,
            max_model_len=args.max_model_len or SIM_MAX_MODEL_LEN,
            profile=None if args.sim_profile == "instant" else args.sim_profile,
            name=str(args.model),
        )
    import uvloop

    from p2pnode.engine.base import EngineStartError
    from p2pnode.node import Node

    try:
        uvloop.run(Node(node_config, engine).serve_forever())
    except (OSError, EngineStartError) as e:  # an address in use, an engine that cannot start: one line
        print(f"p2pnode serve: {e}", file=sys.stderr)
        return 1
    return 0


def _lora_module(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, Path(path)


def _lora_config(args: argparse.Namespace) -> cfg.LoraConfig:
    if (args.enable_lora or args.lora_modules or args.lora_allowed_dir) and args.engine != "vllm":
        raise SystemExit("p2pnode serve: LoRA adapters need --engine vllm")
    try:
        return cfg.LoraConfig(
            enabled=args.enable_lora,
            modules=tuple(args.lora_modules),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            allowed_dirs=tuple(args.lora_allowed_dir),
        )
    except ValueError as e:
        raise SystemExit(f"p2pnode serve: {e}") from None


def _engine_args(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """--engine-arg items checked by vLLM's own parser (imports vLLM: only when some are given)."""
    if not args.engine_arg:
        return ()
    if args.engine != "vllm":
        raise SystemExit("p2pnode serve: --engine-arg applies to --engine vllm only")
    from p2pnode.engine.vllm_args import EngineArgError, parse_engine_args

    try:
        return parse_engine_args(args.engine_arg)
    except EngineArgError as e:
        raise SystemExit(f"p2pnode serve: {e}") from None


def main(argv: list[str] | None = None) -> int:
    from p2pnode.config_file import ConfigFileError, expand

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand(argv, {"serve": parser.serve_parser})  # type: ignore[attr-defined]
    except ConfigFileError as e:
        parser.exit(2, f"p2pnode: error: {e}\n")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "sim":
        from p2pnode.sim.cli import run_sim

        return run_sim(args)
    from p2pnode import client

    if args.command == "generate":
        return asyncio.run(client.generate_command(args))
    return asyncio.run(client.status_command(args))


if __name__ == "__main__":
    sys.exit(main())
