"""The flags of the client commands: ``p2pnode generate`` and ``p2pnode status``."""

from __future__ import annotations

import argparse
import os

from p2pnode.cli.args import host_port, positive_float, token_ids
from p2pnode.cli.serve_flags import add_client_tls


def add_client_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=os.environ.get("P2PNODE_API_KEY"),
                   help="API key of the node (default: $P2PNODE_API_KEY)")


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="send one Generate call and print the result")
    p.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    p.add_argument("--target", type=host_port, default="127.0.0.1:50051", help="any node's address")
    p.add_argument("--token-ids", type=token_ids, help="comma-separated token ids instead of text")
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
    p.add_argument("--timeout", type=positive_float, default=120.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_client_auth(p)
    add_client_tls(p)


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a node's status")
    p.add_argument("--target", type=host_port, default="127.0.0.1:50051")
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument("--json", action="store_true")
    add_client_auth(p)
    add_client_tls(p)

