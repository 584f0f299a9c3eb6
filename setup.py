"""Generate the gRPC stubs from proto/ whenever the package is built or installed.

The generated modules land in rollout_api/ (git-ignored, beside its tracked __init__.py) and are never edited by
hand. ``--proto_path=rollout_api=proto/rollout/v1`` maps the proto to that import
path so the generated ``*_pb2_grpc.py`` imports ``rollout_api.rollout_pb2``.
"""

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


def generate_stubs() -> None:
    from grpc_tools import protoc

    out = ROOT / "rollout_api"
    out.mkdir(exist_ok=True)
    (out / "__init__.py").touch()
    args = [
        "grpc_tools.protoc",
        f"--proto_path=rollout_api={ROOT / 'proto' / 'rollout' / 'v1'}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        str(ROOT / "proto" / "rollout" / "v1" / "rollout.proto"),
    ]
    # Type stubs (.pyi) when mypy-protobuf is present; its plugin sits beside the interpreter.
    plugin = shutil.which("protoc-gen-mypy") or str(Path(sys.executable).parent / "protoc-gen-mypy")
    if Path(plugin).exists():
        args[1:1] = [f"--plugin=protoc-gen-mypy={plugin}", f"--mypy_out={ROOT}"]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed to generate the rollout.v1 stubs")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


if __name__ == "stubs":  # `make proto`: regenerate without building
    generate_stubs()
else:
    setup(cmdclass={"build_py": BuildPyWithStubs})
