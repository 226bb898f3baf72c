"""The committed gRPC stubs are what serve/gen_stubs.py generates from serve/jaxinfer.proto."""
import subprocess
import sys

from google.protobuf import descriptor_pb2

from serve import gen_stubs
from serve import jaxinfer_pb2


def _clear_json_names(messages):
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _clear_json_names(m.nested_type)


def test_committed_descriptor_matches_the_proto(tmp_path):
    """Whatever grpcio-tools is installed: the proto compiles to exactly the committed schema."""
    out = tmp_path / "proto.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{gen_stubs.ROOT}",
                    f"--descriptor_set_out={out}", str(gen_stubs.ROOT / gen_stubs.PROTO)],
                   check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _clear_json_names(fresh.message_type)  # the descriptor set has them, the pb2 leaves them out
    committed = descriptor_pb2.FileDescriptorProto.FromString(jaxinfer_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed


def test_regenerating_gives_identical_files(tmp_path):
    """Byte-for-byte, with the pinned generator; with another one gen_stubs must refuse (the
    stubs would then not import on older runtimes)."""
    if gen_stubs.installed_tools_version() == gen_stubs.GRPCIO_TOOLS_VERSION:
        gen_stubs.generate(tmp_path)
        assert gen_stubs.differing(tmp_path) == []
    else:
        assert gen_stubs.main(["--check"]) == 2


def test_stub_headers_say_generated():
    for f in gen_stubs.GENERATED[::2]:
        head = (gen_stubs.ROOT / f).read_text().splitlines()[:3]
        assert any("DO NOT EDIT" in line for line in head), f
