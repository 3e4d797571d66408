"""Argument types of the ``p2pnode`` command line: each parses one flag's text or says in one line why not."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import NoReturn

from p2pnode.config import TenantSpec
from p2pnode.routing.policies import get_spec


def routing_policy(text: str) -> str:
    """A registered policy, or a what-if of one (``p2p@w8``): ``get_spec`` says why not."""
    try:
        get_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag (the usage of ``serve`` is dozens of lines)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(text: str, kind: type[float] | type[int], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = number(text, float, "a positive number of seconds")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_BYTE_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip


def byte_size(text: str) -> int:
    """A number of bytes >= 0, plain or with a unit: ``17179869184``, ``16GiB``, ``256GB``, ``1.5TiB``."""
    stripped = text.strip()
    digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    unit = _BYTE_UNITS.get(stripped[len(digits):].strip().lower())
    if unit is None:
        raise argparse.ArgumentTypeError(f"must be a size in bytes (e.g. 16GiB, 256GB, 1048576), got {text!r}")
    value = number(digits, float, "a size in bytes (e.g. 16GiB, 256GB, 1048576)") * unit
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return int(value)


def fraction(text: str) -> float:
    value = number(text, float, "a fraction in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def host_port(text: str) -> str:
    from p2pnode.api.listen import BadAddress, split_host_port

    try:
        split_host_port(text)
    except BadAddress as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def http_address(text: str) -> str:
    return text if text.strip().lower() in ("off", "none", "") else host_port(text)


def log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def token_ids(text: str) -> list[int]:
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


def lora_module(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, Path(path)


def tenant_spec(value: str) -> TenantSpec:
    """``--tenant NAME[=KEY][,weight=W][,rps=R][,tps=T]`` (p2pnode/serving/tenants.py)."""
    from p2pnode.serving.tenants import parse_tenant  # the serving package imports far more than the CLI needs here

    try:
        return parse_tenant(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (expected NAME[=KEY][,weight=W][,rps=R][,tps=T][,priority=P])") from None
