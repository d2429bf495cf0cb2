"""Regenerate the committed protobuf/gRPC modules from proto/ (``make proto``; a checkout tool,
not part of the package).

The .proto files live in ``proto/shmtransport/v1``; their package path mirrors the import path, so
the generated modules land in ``src/shmtransport/v1`` and import each other as ``shmtransport.v1``.
A test regenerates into a temporary folder and fails when the committed code is out of date.
"""
from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
SRC_ROOT = REPO / "src"


def proto_files() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / "shmtransport" / "v1").glob("*.proto")) + sorted((PROTO_ROOT / "vllm").glob("*.proto"))


# Foreign schemas (package ``vllm``) are generated next to ours as ``vllm_<name>_pb2*`` so they never
# shadow the real ``vllm`` Python package; their generated imports are rewritten to match.
FOREIGN = ("vllm",)


def _relocate_foreign(out_root: pathlib.Path) -> None:
    target = out_root / "shmtransport" / "v1"
    for pkg in FOREIGN:
        src_dir = out_root / pkg
        if not src_dir.is_dir():
            continue
        for path in sorted(src_dir.glob("*_pb2*.py*")):
            text = path.read_text().replace(f"from {pkg} import ", "from shmtransport.v1 import ")
            for stem in {p.name.split("_pb2")[0] for p in src_dir.glob("*_pb2*.py*")}:
                text = text.replace(f"import {stem}_pb2 as {pkg}_dot_{stem}__pb2",
                                    f"import {pkg}_{stem}_pb2 as {pkg}_dot_{stem}__pb2")
            (target / f"{pkg}_{path.name}").write_text(text)
            path.unlink()
        src_dir.rmdir()


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpcio-tools) for every .proto; returns the generated files."""
    from grpc_tools import protoc

    include = pathlib.Path(protoc.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    _relocate_foreign(out_root)
    return sorted((out_root / "shmtransport" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    for path in generate(SRC_ROOT):
        print(f"generated {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
