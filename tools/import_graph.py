"""The project's import graph, and the layering rules it must keep.

    python tools/import_graph.py          # packages, and who imports whom
    python tools/import_graph.py --modules  # every module's project imports
    python tools/import_graph.py --check  # exit 1 and name each broken rule

Imports are read with ``ast`` from the source (function-level ones included, so a lazy
import cannot hide a dependency); nothing is imported. ``tests/unit/tools/test_import_rules.py``
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
PACKAGES = (
    "rollout_api", "rollout_common", "rollout_service", "trainer_client", "rollout_demo", "rollout_env",
    "vllm_gloo_transfer",
)  # fmt: skip
GENERATED = ("rollout_api.rollout_pb2", "rollout_api.rollout_pb2_grpc")
"""Generated from the proto: not held to the rules (the gRPC stubs import grpc, by design)."""

GRPC_EDGE = (
    "rollout_service.edge.server",
    "rollout_service.edge.servicer",
    "rollout_service.edge.security",
    "rollout_service.edge.reflection",
    "rollout_api.client",
    "rollout_api.top",
)
"""The only modules that speak gRPC: the service's server and servicer, its security (TLS, tokens) and
reflection, and the Python client of the API with the live view built on it (shared by
both sides' CLIs). Everything else works with plain Python types and errors."""

ENGINE = "rollout_service.engine"
SERVICE_CORE = (
    "rollout_service.generation", "rollout_service.scoring", "rollout_service.delivery", "rollout_service.weights",
    "rollout_service.service", "rollout_service.runs", "rollout_service.edge",
)  # fmt: skip
"""The stages (and the runs, the service and the edge that use them): what the engine
(HTTP clients of vLLM, its pool and the managed server) must not depend on."""


STAGES = (
    "rollout_service.engine", "rollout_service.generation", "rollout_service.scoring", "rollout_service.delivery",
    "rollout_service.edge",
)  # fmt: skip
"""The data path, in order: a stage imports earlier stages only, never a later one."""
WEIGHTS = "rollout_service.weights"
"""Beside the stages: it drives the engine, and only the edge (and the service) drives it."""
FOUNDATION = (
    "rollout_service.config", "rollout_service.types", "rollout_service.errors", "rollout_service.metrics",
    "rollout_service.versions",
)  # fmt: skip
"""What every stage imports: it imports no stage."""


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
            if within(module, "rollout_service") and within(name, ("trainer_client", "rollout_demo")):
                found.append(Violation(module, name, "the service does not import the trainer"))
            if within(module, "rollout_env") and within(name, ("rollout_service", "trainer_client", "rollout_demo")):
                found.append(Violation(module, name, "environment runners are clients, installed alone"))
            if within(module, ("rollout_api", "rollout_common", "vllm_gloo_transfer")) and within(
                name, ("rollout_service", "trainer_client", "rollout_demo")
            ):
                found.append(Violation(module, name, "shared packages import neither side"))
            named_by_its_module = name.rsplit(".", 1)[0] in imported and name.rsplit(".", 1)[0] in graph
            if within(module, ENGINE) and within(name, SERVICE_CORE):
                found.append(Violation(module, name, "the engine imports nothing from scheduling, scoring or delivery"))
            elif not named_by_its_module and (rule := stage_order_broken(module, name)):
                found.append(Violation(module, name, rule))
    return found + cycles(graph)


def stage_of(name: str) -> int | None:
    return next((index for index, stage in enumerate(STAGES) if within(name, stage)), None)


def stage_order_broken(module: str, name: str) -> str | None:
    """Which data-path rule importing ``name`` from ``module`` breaks, if any."""
    own, imported = stage_of(module), stage_of(name)
    if own is not None and imported is not None and imported > own:
        return f"a stage imports earlier stages only ({' <- '.join(s.rsplit('.', 1)[1] for s in STAGES)})"
    if within(name, WEIGHTS) and (within(module, FOUNDATION) or (own is not None and STAGES[own] != STAGES[-1])):
        return "only the edge and the service drive the weights"
    if within(module, WEIGHTS) and imported is not None and imported > 0:
        return "the weights import no stage but the engine"
    if within(module, FOUNDATION) and imported is not None:
        return "config, types, errors, metrics and versions import no stage"
    return None


def cycles(graph: dict[str, set[str]]) -> list[Violation]:
    """One violation per import cycle among the graph's modules (each strongly connected
    component of more than one module), naming the cycle."""
    edges = {module: sorted(n for n in imported if n in graph and n != module) for module, imported in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[Violation] = []

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative: no recursion limit
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        path = cycle_through(sorted(component)[0], set(component), edges)
                        found.append(Violation(path[0], path[1], f"no import cycles ({' -> '.join(path)})"))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(edges[child])))
            elif child in stack:
                low[node] = min(low[node], index[child])

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def cycle_through(start: str, component: set[str], edges: dict[str, list[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside its component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in edges[node]:
                if child == start:
                    return [*paths[node], start]
                if child in component and child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


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
