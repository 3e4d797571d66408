"""The serve flags of the HTTP API, keys and logs, and the ready line the launcher parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode import cli
from p2pnode.cli import serve
from p2pnode.config import derived_http_listen
from p2pnode.launcher import _READY


def serve_args(*extra: str):  # type: ignore[no-untyped-def]
    return cli.build_parser().parse_args(["serve", "--model", "m", "--node-id", "n", *extra])


def test_the_http_address_follows_the_grpc_one_unless_set() -> None:
    assert derived_http_listen("127.0.0.1:50051") == "127.0.0.1:51051"
    assert derived_http_listen("0.0.0.0:0") == "0.0.0.0:0"
    assert derived_http_listen("[::1]:50052") == "[::1]:51052"
    with pytest.raises(ValueError, match="--http-listen"):
        derived_http_listen("127.0.0.1:65000")
    assert serve.http_listen(serve_args()) is None  # derived by the node
    assert serve.http_listen(serve_args("--http-listen", "off")) == ""
    assert serve.http_listen(serve_args("--http-listen", "0.0.0.0:8000")) == "0.0.0.0:8000"
    with pytest.raises(SystemExit, match="http-listen"):
        serve.http_listen(serve_args("--listen", "127.0.0.1:65000"))


def test_api_keys_from_flags_and_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n\n  sk-two  \n")
    args = serve_args("--api-key", "sk-flag", "--api-key-file", str(keys))
    assert serve.api_keys(args) == ("sk-flag", "sk-one", "sk-two")
    assert serve.api_keys(serve_args()) == ()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="no key"):
        serve.api_keys(serve_args("--api-key-file", str(tmp_path / "empty")))


def test_log_format_and_stats_interval_flags() -> None:
    args = serve_args("--log-format", "json", "--stats-interval", "0", "--served-model-name", "a", "b")
    assert (args.log_format, args.stats_interval, args.served_model_name) == ("json", 0.0, ["a", "b"])
    with pytest.raises(SystemExit):
        serve_args("--log-format", "xml")


def test_the_ready_line_carries_both_addresses() -> None:
    m = _READY.search("p2pnode n1 ready on 127.0.0.1:50051 http 127.0.0.1:51051")
    assert m is not None and m.groups() == ("n1", "127.0.0.1:50051", "127.0.0.1:51051")
    m = _READY.search("p2pnode n1 ready on 127.0.0.1:50051")  # HTTP off (or an older node)
    assert m is not None and m.groups() == ("n1", "127.0.0.1:50051", None)
