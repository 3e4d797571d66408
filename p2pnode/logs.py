"""Logging for ``p2pnode serve``: text lines, or one JSON object per line (``--log-format json``).

JSON uses python-json-logger (vLLM's own choice for its JSON logs); a record's ``extra`` fields become keys, so
the access log's ``access`` object (id, api, ingress, served_by, policy, tokens, cached, TTFT, status) is
machine-readable as is. vLLM configures its own ``vllm`` logger in every process it starts (the engine core is a
child process); in JSON mode the node hands it a dictConfig file through ``VLLM_LOGGING_CONFIG_PATH`` before
vLLM is imported, so the engine's lines are JSON objects too.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The keys every JSON line carries (python-json-logger reads them from this format string).
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
JSON_FORMATTER = "pythonjsonlogger.json.JsonFormatter"


def _vllm_json_config(level: str) -> dict[str, object]:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JSON_FORMATTER, "fmt": JSON_FIELDS}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def configure(level: str = "INFO", fmt: str = "text", access_log: bool = True) -> None:
    """Configure the root logger (and, for JSON, vLLM's loggers in this process and its children); without
    ``access_log`` the per-request lines (logger ``p2pnode.access``) are dropped."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(JSON_FIELDS))
        if "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
            with tempfile.NamedTemporaryFile("w", prefix="p2pnode-vllm-logging-", suffix=".json", delete=False) as f:
                json.dump(_vllm_json_config(level.upper()), f)
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = f.name
            atexit.register(_remove, f.name)
    elif fmt == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("p2pnode.access").setLevel(logging.NOTSET if access_log else logging.WARNING)
