"""Regenerate the Python gRPC code in p2pnode/v1/ from protos/p2pnode/v1/*.proto.

    python scripts/gen_protos.py            # rewrite p2pnode/v1/
    python scripts/gen_protos.py --check    # exit 1 when the checked-in code is stale

The generated modules import each other as ``p2pnode.v1.*``, so ``protos/`` is the include root and the output
lands inside the ``p2pnode`` package.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = "p2pnode/v1"
INIT_TEXT = '"""Generated gRPC code for protos/p2pnode/v1 (scripts/gen_protos.py). Do not edit."""\n'


def generate(out_root: Path) -> list[Path]:
    """Compile every proto under protos/p2pnode/v1 into out_root/p2pnode/v1; return the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    out_dir = out_root / PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    return sorted(out_dir.iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the checked-in code, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        built = generate(Path(tmp))
        target = ROOT / PACKAGE_DIR
        stale = [p.name for p in built if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name)]
        extra = sorted({p.name for p in target.glob("*.py*")} - {p.name for p in built}) if target.exists() else []
        if args.check:
            if stale or extra:
                print(f"stale generated code in {PACKAGE_DIR}: {stale + extra}; run scripts/gen_protos.py")
                return 1
            print(f"{PACKAGE_DIR} is up to date")
            return 0
        target.mkdir(parents=True, exist_ok=True)
        for name in extra:
            (target / name).unlink()
        for p in built:
            shutil.copyfile(p, target / p.name)
        print(f"wrote {len(built)} files to {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
