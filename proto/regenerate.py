"""Regenerate the committed gRPC stubs from ``gossip.proto`` and ``coordinator.proto``.

The stubs are committed so that installing gossipd never needs protoc; a test
runs this into a temporary folder and fails when the committed files drift.
``python -m gossipd.proto.regenerate`` rewrites them in place.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("gossip", "coordinator")
GENERATED = tuple(
    f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every file of ``PROTOS`` into ``out_dir`` and return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        # Map the file to gossipd/proto/ so generated imports read `from gossipd.proto import ...`.
        args = [
            "protoc",
            f"-I{include}",
            f"-Igossipd/proto={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"gossipd/proto/{name}.proto" for name in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} in {PROTO_DIR}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            target.write_bytes((Path(tmp) / "gossipd" / "proto" / name).read_bytes())
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
