"""``p2pnode serve --config FILE.yaml``: flags from a YAML file as ``vllm serve --config`` reads them (the command
line wins over the file, the file over the defaults); a key that is no flag is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode.cli import build_parser
from p2pnode.config_file import ConfigFileError, expand


def parse(argv: list[str]):
    parser = build_parser()
    return parser.parse_args(expand(argv, {"serve": parser.serve_parser}))


def test_flags_come_from_the_file_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(
        "node-id: n9\nmax_model_len: 512\nenforce-eager: true\nserved-model-name: [tiny, other]\n"
        "engine-arg:\n  max_num_batched_tokens: 4096\napi-key: [k1, k2]\nhttp-listen: 127.0.0.1:9999\n"
    )
    args = parse(["serve", "--model", "m", "--config", str(config), "--max-model-len", "1024"])
    assert (args.node_id, args.max_model_len, args.enforce_eager) == ("n9", 1024, True)
    assert args.served_model_name == ["tiny", "other"] and args.api_key == ["k1", "k2"]
    assert args.engine_arg == ["max_num_batched_tokens=4096"] and args.http_listen == "127.0.0.1:9999"


def test_a_key_that_is_no_flag_is_refused_by_name(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("node-id: n1\nmodell: ./models/tiny\n")
    with pytest.raises(ConfigFileError, match="'modell' is not a flag"):
        parse(["serve", "--model", "m", "--config", str(config)])
    json_file = tmp_path / "node.json"
    json_file.write_text("{}")
    with pytest.raises(ConfigFileError, match="yaml"):
        parse(["serve", "--model", "m", "--node-id", "n", "--config", str(json_file)])


def test_a_key_left_blank_is_refused_by_name(tmp_path: Path) -> None:
    """Before: ``api-key:`` left blank became the flag's value "None" -- an API key anyone could send."""
    config = tmp_path / "node.yaml"
    config.write_text("node-id: n1\napi-key:\n")
    with pytest.raises(ConfigFileError, match="'api-key' has no value"):
        parse(["serve", "--model", "m", "--config", str(config)])


def test_the_file_may_be_given_with_an_equals_sign(tmp_path: Path) -> None:
    """Before: ``--config=FILE`` was parsed into a flag nothing read: the file was ignored without a word."""
    config = tmp_path / "node.yaml"
    config.write_text("node-id: n9\nhttp-listen: 127.0.0.1:9999\n")
    args = parse(["serve", "--model", "m", f"--config={config}"])
    assert (args.node_id, args.http_listen, args.config) == ("n9", "127.0.0.1:9999", None)


def test_an_abbreviated_config_flag_is_refused_not_ignored(tmp_path: Path) -> None:
    from p2pnode.cli.serve import run_serve

    config = tmp_path / "node.yaml"
    config.write_text("http-listen: 127.0.0.1:9999\n")
    args = parse(["serve", "--model", "m", "--node-id", "n1", "--conf", str(config)])  # argparse's abbreviation
    with pytest.raises(SystemExit, match="--config"):
        run_serve(args)


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--lora-allowed-dir", "/tmp"], "--lora-allowed-dir needs --enable-lora"),  # every load was a 400 "off"
        (["--max-message-bytes", str(1 << 31)], "--max-message-bytes must be between"),  # gRPC's OverflowError
    ],
)
def test_flags_that_cannot_work_are_refused_at_start_in_one_line(flags: list[str], refusal: str) -> None:
    from p2pnode.cli.serve import node_config_of

    args = parse(["serve", "--model", "m", "--node-id", "n1", *flags])
    with pytest.raises(SystemExit, match=refusal):
        node_config_of(args)
