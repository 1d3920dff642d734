"""Regenerates the Python modules of ``coordinator.proto``: ``python -m jaxpod.proto.regen``.

The ``.proto`` is compiled as ``jaxpod/proto/coordinator.proto`` so the generated
modules import each other as ``jaxpod.proto.*`` (the folder is installed under that
name). ``--check`` compares instead of writing and exits 1 on drift.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("coordinator.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate() -> dict[str, bytes]:
    """Compiles the protos in a scratch tree; returns ``{file name: contents}``."""
    from grpc_tools import protoc  # the [test] extra; not needed at run time

    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp, "jaxpod", "proto")
        package.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(HERE / name, package / name)
        include = str(Path(protoc.__file__).parent / "_proto")
        args = ["protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"jaxpod/proto/{name}" for name in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        return {p.name: p.read_bytes() for p in sorted(package.iterdir())
                if p.name.endswith(GENERATED_SUFFIXES)}


def drifted() -> list[str]:
    """Generated files that differ from (or are missing next to) the checked-in ones."""
    return [name for name, data in generate().items()
            if not (HERE / name).exists() or (HERE / name).read_bytes() != data]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the checked-in modules differ from the .proto")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted()
        for name in stale:
            print(f"proto/{name} is stale; run: python -m jaxpod.proto.regen", file=sys.stderr)
        return 1 if stale else 0
    for name, data in generate().items():
        (HERE / name).write_bytes(data)
        print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
