"""The project's own imports point one way: no cycles, and launch/k8s/jobspec never reach jax
or runtime. Read from the source with ast, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

from runs import ROOT

PACKAGES = ("jobspec", "runtime", "launch", "k8s")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports (absolute, relative resolved; `from a import b` adds a.b)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for name in _imports(path, mod):
            # `import a.b.c` also runs a and a.b: each enclosing package is a dependency.
            parts = name.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[mod] = {d for d in deps if d in files and d != mod and not mod.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return [*stack[stack.index(v) :], v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_project() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_launch_k8s_and_jobspec_stay_jax_free_and_never_import_runtime() -> None:
    bad = []
    for pkg in ("jobspec", "launch", "k8s"):
        for path in (ROOT / pkg).rglob("*.py"):
            for name in _imports(path, _module_name(path)):
                top = name.split(".")[0]
                if top in ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "runtime"):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad
