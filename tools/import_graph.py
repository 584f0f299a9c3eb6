"""The project's import graph, and the layering rules it must keep.

    python tools/import_graph.py          # packages, and who imports whom
    python tools/import_graph.py --modules  # every module's project imports
    python tools/import_graph.py --check  # exit 1 and name each broken rule

Imports are read with ``ast`` from the source (function-level ones included, so a lazy
import cannot hide a dependency); nothing is imported. ``tests/unit/test_import_rules.py``
runs the check in the suite.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout_api", "rollout_common", "rollout_service", "trainer_client", "rollout_demo", "vllm_gloo_transfer")
GENERATED = ("rollout_api.rollout_pb2", "rollout_api.rollout_pb2_grpc")
"""Generated from the proto: not held to the rules (the gRPC stubs import grpc, by design)."""

GRPC_EDGE = (
    "rollout_service.edge.server",
    "rollout_service.edge.security",
    "rollout_service.edge.reflection",
    "trainer_client.client",
    "trainer_client.top",
)
"""The only modules that speak gRPC: the service's server, its security (TLS, tokens) and
reflection, the trainer's client and the live view built on it. Everything else works with
plain Python types and errors."""

CLIENT_COMMANDS = {"rollout_service.edge.cli": ("trainer_client.top", "trainer_client.client")}
"""Service CLI modules that may import a client-side module for a command that is a client
of the service (``rollout-service top``), imported inside the command only."""

ENGINE = "rollout_service.engine"
SERVICE_CORE = (
    "rollout_service.generation", "rollout_service.scoring", "rollout_service.delivery", "rollout_service.weights",
    "rollout_service.service", "rollout_service.runs", "rollout_service.edge",
)  # fmt: skip
"""The stages (and the runs, the service and the edge that use them): what the engine
(HTTP clients of vLLM, its pool and the managed server) must not depend on."""


@dataclass(frozen=True)
class Violation:
    module: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.module} imports {self.imported}: {self.rule}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names this file imports (``from a import b`` gives ``a.b`` and ``a``, since
    ``b`` may be a module or a name in ``a``)."""
    names: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def project_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each project module -> the names it imports (project and third-party)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path)
            if not name.startswith(GENERATED):
                graph[name] = imports_of(path)
    return graph


def within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(graph: dict[str, set[str]]) -> list[Violation]:
    found: list[Violation] = []
    for module, imported in sorted(graph.items()):
        for name in sorted(imported):
            if (within(name, "grpc") or within(name, "rollout_api.rollout_pb2_grpc")) and not within(module, GRPC_EDGE):
                found.append(Violation(module, name, "only the gRPC edge imports grpc"))
            if within(module, "trainer_client") and within(name, ("rollout_service", "rollout_demo")):
                found.append(Violation(module, name, "the trainer does not import the service"))
            client_command = within(name, CLIENT_COMMANDS.get(module, ()))
            trainer_side = within(name, ("trainer_client", "rollout_demo"))
            if within(module, "rollout_service") and trainer_side and not client_command:
                found.append(Violation(module, name, "the service does not import the trainer"))
            if within(module, ("rollout_api", "rollout_common", "vllm_gloo_transfer")) and within(
                name, ("rollout_service", "trainer_client", "rollout_demo")
            ):
                found.append(Violation(module, name, "shared packages import neither side"))
            if within(module, ENGINE) and within(name, SERVICE_CORE):
                found.append(Violation(module, name, "the engine imports nothing from scheduling, scoring or delivery"))
    return found


def package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        source = module.split(".")[0]
        for name in imported:
            target = name.split(".")[0]
            if target in PACKAGES and target != source:
                edges[source].add(target)
    return edges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", action="store_true", help="every module's project imports")
    parser.add_argument("--check", action="store_true", help="exit 1 if a rule is broken")
    args = parser.parse_args(argv)
    graph = project_graph()
    if args.modules:
        for module, imported in sorted(graph.items()):
            ours = sorted({n for n in imported if n.split(".")[0] in PACKAGES and n in graph})
            print(f"{module}: {', '.join(ours) or '-'}")
    else:
        for package in PACKAGES:
            print(f"{package} -> {', '.join(sorted(package_edges(graph).get(package, ()))) or '-'}")
        grpc_users = sorted(m for m, imported in graph.items() if any(within(n, "grpc") for n in imported))
        print(f"imports grpc: {', '.join(grpc_users)}")
    broken = violations(graph)
    for violation in broken:
        print(f"BROKEN: {violation}", file=sys.stderr)
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
