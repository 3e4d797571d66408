"""``p2pnode serve --config FILE.yaml``: flags from a YAML file, as ``vllm serve --config`` reads them.

Each key is a flag's name (dashes or underscores), each value its argument: ``true`` gives the switch (``false``
its ``--no-`` form if there is one, else nothing), a list gives the flag's values (a repeatable flag such as
``--engine-arg`` or ``--api-key`` once per item), a mapping under ``engine-arg`` gives ``KEY=VALUE`` items, any other
mapping its JSON (vLLM's nested configs), anything else its text. The file's flags go right after ``serve``, so
flags given on the command line win, as in vLLM (command line > config file > defaults).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A --config file that cannot be read or names no flag of the command (the message says which)."""


def _flag(key: str) -> str:
    return "--" + str(key).strip().lstrip("-").replace("_", "-")


def config_args(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a YAML file holds, as command-line arguments of ``parser``."""
    import yaml

    if path.suffix not in (".yaml", ".yml"):
        raise ConfigFileError(f"--config {path}: must be a .yaml or .yml file")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigFileError(f"--config {path}: {e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigFileError(f"--config {path}: must hold a mapping of flags to values")
    actions = parser._option_string_actions
    args: list[str] = []
    for key, value in config.items():
        flag = _flag(key)
        action = actions.get(flag)
        if value is None:  # ``key:`` left blank: str(None) made it the flag's value "None" (an API key "None"...)
            raise ConfigFileError(f"--config {path}: {key!r} has no value (remove it, or give one)")
        if action is None and not (isinstance(value, bool) and not value and f"--no-{flag[2:]}" in actions):
            raise ConfigFileError(f"--config {path}: {key!r} is not a flag of this command")
        args += _values(flag, value, action, actions)
    return args


def _values(flag: str, value: Any, action: argparse.Action | None, actions: dict[str, argparse.Action]) -> list[str]:
    if isinstance(value, bool):
        if value:
            return [flag]
        no = f"--no-{flag[2:]}"
        return [no] if no in actions else []
    repeat = isinstance(action, argparse._AppendAction)
    if isinstance(value, dict) and flag == "--engine-arg":
        value = [f"{k}={json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in value.items()]
    if isinstance(value, list):
        if not value:
            return []
        if repeat:
            return [part for item in value for part in (flag, str(item))]
        return [flag, *(str(item) for item in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def expand(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """``argv`` with ``--config FILE`` (or ``--config=FILE``) replaced by the file's flags, right after the
    subcommand."""
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else (arg,))]
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise ConfigFileError("--config: give one config file")
    at = argv.index("--config")
    if at == len(argv) - 1:
        raise ConfigFileError("--config: expects a file")
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command not in parsers:
        raise ConfigFileError(f"--config applies to {', '.join(sorted(parsers))}")
    flags = config_args(Path(argv[at + 1]), parsers[command])
    rest = argv[1:at] + argv[at + 2 :]
    return [command, *flags, *rest]
