"""The committed stubs in tandem/v1 match the protos, and the protos follow the house rules.

Rules checked: package tandem.v1, a comment on every service, rpc, message, field,
enum and enum value, and every enum starting at *_UNSPECIFIED = 0.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import resources
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_protos = _load_gen_protos()


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    (tmp_path / "tandem" / "v1").mkdir(parents=True)
    fresh = gen_protos.generate(tmp_path)
    committed = gen_protos.generated_files(REPO_ROOT)
    assert committed == fresh, "stub files differ from the protos; run `python scripts/gen_protos.py`"
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (REPO_ROOT / p).read_bytes()]
    assert stale == [], f"stale stubs {stale}; run `python scripts/gen_protos.py`"


def test_every_proto_has_stubs() -> None:
    names = {p.stem for p in gen_protos.proto_files()}
    assert names == {"common", "gateway", "scheduler", "worker", "kv_transfer"}
    for name in names:
        assert importlib.import_module(f"tandem.v1.{name}_pb2").DESCRIPTOR.package == "tandem.v1"


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("ds") / "tandem.pb"
    include = resources.files("grpc_tools") / "_proto"
    args = ["protoc", f"-I{gen_protos.PROTO_ROOT}", f"-I{include}", f"--descriptor_set_out={out}",
            "--include_source_info", *(str(p) for p in gen_protos.proto_files())]
    assert protoc.main(args) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _elements(file: descriptor_pb2.FileDescriptorProto):
    """Yield (source path, qualified name) of every element that needs a comment."""
    for i, service in enumerate(file.service):
        yield (6, i), service.name
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"{service.name}.{method.name}"
    for i, enum in enumerate(file.enum_type):
        yield from _enum_elements((5, i), enum)
    for i, message in enumerate(file.message_type):
        yield from _message_elements((4, i), message)


def _enum_elements(path: tuple[int, ...], enum: descriptor_pb2.EnumDescriptorProto):
    yield path, enum.name
    for j, value in enumerate(enum.value):
        yield (*path, 2, j), f"{enum.name}.{value.name}"


def _message_elements(path: tuple[int, ...], message: descriptor_pb2.DescriptorProto):
    yield path, message.name
    for j, field in enumerate(message.field):
        yield (*path, 2, j), f"{message.name}.{field.name}"
    for j, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:  # a map field's entry type is synthetic: its field carries the comment
            yield from _message_elements((*path, 3, j), nested)
    for j, enum in enumerate(message.enum_type):
        yield from _enum_elements((*path, 4, j), enum)


def test_every_element_is_commented(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    missing = []
    for file in descriptor_set.file:
        assert file.package == "tandem.v1", file.name
        commented = {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}
        missing += [f"{file.name}: {name}" for path, name in _elements(file) if path not in commented]
    assert missing == []


def test_enums_start_at_unspecified(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    for file in descriptor_set.file:
        for enum in file.enum_type:
            first = enum.value[0]
            assert (first.number, first.name.endswith("_UNSPECIFIED")) == (0, True), f"{file.name}: {enum.name}"
