"""``p2pnode`` command line: serve | generate | status | sim.

``serve_flags.py`` and ``serve.py`` are ``serve`` (its flags; from them to a running node), ``client_flags.py`` the
client commands' flags (``p2pnode/client.py`` runs them), ``args.py`` the argument types; ``sim`` lives with the
simulator (``p2pnode/sim/cli.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from p2pnode.cli.args import Parser
from p2pnode.cli.client_flags import add_generate, add_status
from p2pnode.cli.serve import run_serve
from p2pnode.cli.serve_flags import add_serve

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="p2pnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parser.serve_parser = add_serve(sub)  # type: ignore[attr-defined]  # --config reads its flags
    add_generate(sub)
    add_status(sub)
    from p2pnode.sim.cli import add_sim_parser

    add_sim_parser(sub)
    return parser


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
        return run_serve(args)
    if args.command == "sim":
        from p2pnode.sim.cli import run_sim

        return run_sim(args)
    from p2pnode import client

    if args.command == "generate":
        return asyncio.run(client.generate_command(args))
    return asyncio.run(client.status_command(args))


if __name__ == "__main__":
    sys.exit(main())

