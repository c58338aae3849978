"""The project's own imports point one way: no cycles; launch, runfolder and jobspec never reach
jax or runtime; jobspec (the contract every side reads) never reaches runfolder or launch, and
runfolder (the run folder, above jobspec) never reaches launch; inside runtime/ every import
points down the package order in docs/layout.md. Read from the source with ast, so lazy imports
inside functions (and type-only imports) count too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from runs import ROOT

PACKAGES = ("jobspec", "runfolder", "runtime", "launch")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        named = _imports(path, mod)
        deps = set()
        for name in named:
            # `import a.b.c` also runs a and a.b: each enclosing package is a dependency.
            parts = name.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        # A module's own enclosing packages are implied by its being imported at all, but one it
        # names (`from launch.backends.local import procs` in launch/backends/local/x.py) is an
        # edge like any other: a cycle through that package's __init__.
        graph[mod] = {
            d for d in deps
            if d in files and d != mod and (d in named or not mod.startswith(d + "."))
        }  # fmt: skip
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


def test_a_module_that_names_its_own_package_is_an_edge(tmp_path: Path) -> None:
    """A submodule importing `from <its package> import x` runs the package's __init__, which
    imports the submodule: a cycle, found; `from <package>.x import y` is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("X = 1\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg", "pkg.a", "pkg"]
    (pkg / "a.py").write_text("from pkg.b import X\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_project() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The jax-free packages, each with the project's packages above it that it must not import.
JAX_FREE = {"jobspec": {"runfolder", "launch"}, "runfolder": {"launch"}, "launch": set()}


def test_launch_runfolder_and_jobspec_stay_jax_free_and_never_import_runtime() -> None:
    banned = {"jax", "jaxlib", "flax", "optax", "orbax", "grain", "runtime"}
    bad = []
    for pkg, above in JAX_FREE.items():
        for path in (ROOT / pkg).rglob("*.py"):
            for name in _imports(path, _module_name(path)):
                top = name.split(".")[0]
                if top in banned or top in above:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


# The table under "Inside `runtime/` ... imports point down this list" in docs/layout.md.
LAYOUT = ROOT / "docs" / "layout.md"
ORDER_INTRO = "imports point down this list"
ORDER_ROW = re.compile(r"\| `runtime/(\w+)/` \|")

# Imports up the order that exist today, each to be removed by the restructure that owns it:
# delete a pair here once its import is gone (the test fails on a stale pair).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def runtime_order() -> list[str]:
    """The runtime packages in the layout page's table, top to bottom."""
    lines = LAYOUT.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if ORDER_INTRO in line)
    order: list[str] = []
    for line in lines[start + 1 :]:
        if row := ORDER_ROW.match(line):
            order.append(row[1])
        elif order and not line.startswith("|"):  # the table has ended
            break
    return order


def upward_imports(order: list[str], root: Path = ROOT) -> set[tuple[str, str]]:
    """(module, package it imports) for each import from a runtime package to one above it."""
    rank = {pkg: i for i, pkg in enumerate(order)}
    out = set()
    for path in (root / "runtime").rglob("*.py"):
        parts = path.relative_to(root / "runtime").parts
        # runtime/__main__.py is the entry point, above every package; a package missing from
        # the table is the other test's failure.
        if len(parts) < 2 or parts[0] not in rank:
            continue
        module = _module_name(path, root)
        for name in _imports(path, module):
            pkg = name.split(".")[1] if name.startswith("runtime.") else None
            if pkg in rank and rank[pkg] < rank[parts[0]]:
                out.add((module, pkg))
    return out


def test_the_layout_lists_every_runtime_package_once() -> None:
    order = runtime_order()
    packages = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").is_file()}
    assert len(order) == len(set(order)) and set(order) == packages, (order, sorted(packages))


def test_runtime_imports_point_down_the_layout_order() -> None:
    found = upward_imports(runtime_order())
    new = sorted(found - KNOWN_UPWARD)
    assert not new, "imports up the runtime package order in docs/layout.md: " + ", ".join(
        f"{module} imports runtime.{pkg}" for module, pkg in new
    )
    stale = sorted(KNOWN_UPWARD - found)
    assert not stale, f"these imports are gone; remove them from KNOWN_UPWARD: {stale}"


def test_upward_imports_finds_one(tmp_path: Path) -> None:
    for name, text in {"top/a.py": "from runtime.low import b\n", "low/b.py": "import runtime.top.a\n",
                       "top/__init__.py": "", "low/__init__.py": ""}.items():  # fmt: skip
        (tmp_path / "runtime" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "runtime" / name).write_text(text)
    assert upward_imports(["top", "low"], tmp_path) == {("runtime.low.b", "top")}
