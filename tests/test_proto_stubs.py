"""The committed gRPC stubs are exactly what ``gossip.proto`` and ``coordinator.proto``
generate (docs/design.md §1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossipd.proto import regenerate

COMMITTED_DIR = Path(__file__).resolve().parents[1] / "proto"


def test_stub_set_is_three_committed_files_per_proto():
    assert regenerate.GENERATED == (
        "gossip_pb2.py",
        "gossip_pb2.pyi",
        "gossip_pb2_grpc.py",
        "coordinator_pb2.py",
        "coordinator_pb2.pyi",
        "coordinator_pb2_grpc.py",
    )
    for name in regenerate.GENERATED:
        assert (COMMITTED_DIR / name).is_file(), f"committed stub {name} is missing"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> dict[str, Path]:
    out_dir = tmp_path_factory.mktemp("stubs")
    written = regenerate.generate(out_dir)
    return {path.name: path for path in written}


def test_generate_writes_every_stub_into_the_given_folder(regenerated):
    assert sorted(regenerated) == sorted(regenerate.GENERATED)
    for path in regenerated.values():
        assert path.is_file() and path.stat().st_size > 0


@pytest.mark.parametrize("name", regenerate.GENERATED)
def test_committed_stub_is_byte_identical_to_regenerated(regenerated, name):
    committed = (COMMITTED_DIR / name).read_bytes()
    fresh = regenerated[name].read_bytes()
    assert fresh == committed, (
        f"proto/{name} drifted from its .proto; run `python -m gossipd.proto.regenerate` "
        "and commit the result"
    )


def test_generated_stubs_import_from_the_installed_package_name(regenerated):
    grpc_stub = regenerated["gossip_pb2_grpc.py"].read_text()
    assert "from gossipd.proto import gossip_pb2" in grpc_stub
    coordinator_stub = regenerated["coordinator_pb2_grpc.py"].read_text()
    assert "from gossipd.proto import coordinator_pb2" in coordinator_stub
