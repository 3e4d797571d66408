"""``p2pnode serve``: from its flags (``serve_flags.py``) to one ``NodeConfig``, an engine, and a running node."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from p2pnode import config as cfg
from p2pnode.gossip import config as gossip_cfg

if TYPE_CHECKING:
    from p2pnode.engine.base import Engine


def gossip_config(args: argparse.Namespace) -> gossip_cfg.GossipConfig | None:
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
        wire_version=args.gossip_wire_version,
        injected_loss=args.chaos_gossip_loss,
        injected_loss_after_s=args.chaos_gossip_loss_after,
        **interval,
    )


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k for k in args.api_key if k]
    if args.api_key_file is not None:
        try:
            keys += [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise SystemExit(f"p2pnode serve: --api-key-file: {e}") from e
        if not keys:
            raise SystemExit("p2pnode serve: --api-key-file: no key in the file")
    return tuple(keys)


def http_listen(args: argparse.Namespace) -> str | None:
    if args.http_listen is None:
        try:
            cfg.derived_http_listen(args.listen)
        except ValueError as e:
            raise SystemExit(f"p2pnode serve: {e}") from e
        return None
    if args.http_listen.lower() in ("off", "none", ""):
        return ""
    return args.http_listen


def run_serve(args: argparse.Namespace) -> int:
    """``p2pnode serve``: the flags as one ``NodeConfig``, the engine it names, and the node until SIGTERM."""
    from p2pnode import json_stdio, logs

    if args.config is not None:  # read only where ``config_file.expand`` replaces it: an abbreviation slipped past
        raise SystemExit(f"p2pnode serve: --config {args.config}: give it as --config FILE (or --config=FILE)")
    if args.log_format == "json":  # before anything writes or starts: every line from here to exit is JSON
        json_stdio.install(cfg.DEFAULT_JSON_STDIO_MAX_LINE_BYTES)
        logging.captureWarnings(True)  # a Python warning is one record, not a message line and a source line
    logs.configure(args.log_level, args.log_format, access_log=not args.no_access_log)
    node_config = node_config_of(args)
    if node_config.tier.enabled:
        from p2pnode.kv.tier.memory import check_host_tier

        if args.engine != "vllm":
            raise SystemExit("p2pnode serve: --host-kv-bytes needs --engine vllm (the simulator's tiers: p2pnode sim)")
        from p2pnode.kv.tier.disk_space import check_disk_tier, check_shared_region

        tier = node_config.tier
        refused = check_host_tier(tier.host_bytes)
        if not refused and tier.disk_enabled:
            refused = check_shared_region(tier.host_bytes) or check_disk_tier(tier.disk_path, tier.disk_bytes)
        if refused:
            raise SystemExit(f"p2pnode serve: {refused}")
    if args.kv_pull_force and node_config.kv_setup.pulls is None:
        raise SystemExit("p2pnode serve: --kv-pull-force needs --kv-link-gbps above 0 and a mesh (a cluster secret)")
    if args.engine == "vllm" and not args.model.is_dir():
        print(f"p2pnode serve: --model {args.model} is not a directory", file=sys.stderr)
        return 2
    import uvloop

    from p2pnode.engine.base import EngineStartError
    from p2pnode.node import Node

    try:
        uvloop.run(Node(node_config, engine_of(args, node_config)).serve_forever())
    except (OSError, EngineStartError) as e:  # an address in use, an engine that cannot start: one line
        print(f"p2pnode serve: {e}", file=sys.stderr)
        return 1
    return 0


def engine_of(args: argparse.Namespace, node_config: cfg.NodeConfig) -> Engine:
    """The engine ``--engine`` names: vLLM with what KV the node moves and keeps, or the simulated one."""
    if args.engine == "vllm":
        from p2pnode.engine.vllm_engine import VllmEngine

        return VllmEngine(node_config.engine, node_id=args.node_id, kv=node_config.kv_setup)
    from p2pnode.engine.simulated.realtime import SIM_MAX_MODEL_LEN, SimEngine

    return SimEngine(
        block_size=args.block_size,
        num_blocks=args.sim_kv_blocks,
        max_model_len=args.max_model_len or SIM_MAX_MODEL_LEN,
        profile=None if args.sim_profile == "instant" else args.sim_profile,
        name=str(args.model),
        stall_timeout_s=args.engine_stall_timeout,
    )


def node_config_of(args: argparse.Namespace) -> cfg.NodeConfig:
    """Every flag of ``serve`` in its place of the node's configuration; a value no part of it takes is one line
    naming it (SystemExit), not a traceback."""
    try:
        return _node_config(args)
    except ValueError as e:
        raise SystemExit(f"p2pnode serve: {e}") from e


def _node_config(args: argparse.Namespace) -> cfg.NodeConfig:
    return cfg.NodeConfig(
        node_id=args.node_id,
        engine=engine_config_of(args),
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
            migration_limit=args.migration_limit,
            plan_period_s=args.plan_period,
            shadow_gate=not args.no_shadow_gate,
            kv_link_gbps=args.kv_link_gbps,
            kv_pull_force=args.kv_pull_force,
        ),
        gossip=gossip_config(args),
        seeds=tuple(s.strip() for s in args.seeds.split(",") if s.strip()),
        advertise=args.advertise,
        api=api_config_of(args),
        forwarding=cfg.ForwardingConfig(
            first_token_timeout_s=args.first_token_timeout, keepalive_s=args.peer_keepalive,
            peer_links=not args.no_peer_links,
        ),
        eviction=cfg.EvictionConfig(policy=args.eviction_policy),
        kv=cfg.KvPullConfig(block_delay_s=args.chaos_kv_block_delay),
        segments=cfg.SegmentConfig(
            store_bytes=int(args.segment_store_mb * 2**20),
            policy=args.segment_policy,
            store_threshold=args.segment_store_threshold,
            summary_bytes=int(args.segment_summary_kb * 1024),
        ),
        tier=tier_config_of(args),
        flow=flow_config_of(args),
    )


def flow_config_of(args: argparse.Namespace) -> cfg.FlowConfig:
    try:
        return cfg.FlowConfig(
            max_queue_length=args.max_queue_length, max_queue_seconds=args.max_queue_seconds,
            tenant_header=args.tenant_header.strip(), priority_header=args.priority_header.strip(),
            tenants=tuple(args.tenant),
        )
    except ValueError as e:
        raise SystemExit(f"p2pnode serve: {e}") from e


def tier_config_of(args: argparse.Namespace) -> cfg.TierConfig:
    try:
        return cfg.TierConfig(
            host_bytes=args.host_kv_bytes, store_threshold=args.tier_store_threshold,
            store_outputs=args.tier_store_outputs, eviction=args.tier_eviction,
            disk_path=str(Path(args.disk_kv_path).expanduser().resolve()) if args.disk_kv_path else "",
            disk_bytes=args.disk_kv_bytes,
        )
    except ValueError as e:
        raise SystemExit(f"p2pnode serve: {e}") from e


def engine_config_of(args: argparse.Namespace) -> cfg.EngineConfig:
    return cfg.EngineConfig(
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
        stall_timeout_s=args.engine_stall_timeout,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine_args=engine_args(args),
        lora=lora_config(args),
        served_model_names=tuple(args.served_model_name or ()) or (args.model.name,),
        chat_template=args.chat_template,
    )


def api_config_of(args: argparse.Namespace) -> cfg.ClientApiConfig:
    return cfg.ClientApiConfig(
        http_listen=http_listen(args),
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=api_keys(args),
        stats_interval_s=args.stats_interval,
        http_header_timeout_s=args.http_header_timeout,
        http_body_timeout_s=args.http_body_timeout,
        http_max_connections_per_client=max(args.http_max_connections_per_client, 0),
        trust_request_chat_template=args.trust_request_chat_template,
    )


def lora_config(args: argparse.Namespace) -> cfg.LoraConfig:
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


def engine_args(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
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

