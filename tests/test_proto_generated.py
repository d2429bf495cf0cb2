"""The committed generated code must match what protoc makes from proto/ today (`make proto`)."""
import pathlib
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import protogen  # noqa: E402


def test_committed_generated_code_matches_proto_sources(tmp_path: pathlib.Path):
    pytest.importorskip("grpc_tools")
    # protoc runs in a child: nixl-cu12 bundles its own protobuf libraries and crashes a process
    # that has both loaded, and other tests may have imported it here.
    code = (f"import sys, pathlib; sys.path.insert(0, {str(TOOLS)!r}); import protogen; "
            f"protogen.generate(pathlib.Path({str(tmp_path)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    fresh = sorted((tmp_path / "shmtransport" / "v1").glob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    committed_dir = protogen.SRC_ROOT / "shmtransport" / "v1"
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is generated but not committed: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{path.name} is out of date: run `make proto`"


def test_handle_is_wire_compatible_with_smg_shm_handle():
    smg = pytest.importorskip("smg_grpc_proto.generated.common_pb2")
    from shmtransport.v1 import daemon_pb2 as pb

    ours = pb.Handle(name="seg", offset=4096, nbytes=123, owner_id="abc", generation=7, instance_id="i")
    theirs = smg.ShmHandle()
    theirs.ParseFromString(ours.SerializeToString())
    assert (theirs.name, theirs.offset, theirs.nbytes, theirs.owner_id) == ("seg", 4096, 123, "abc")
    back = pb.Handle()
    back.ParseFromString(theirs.SerializeToString())  # unknown fields survive the round trip
    assert back == ours
