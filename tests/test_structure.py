"""The shape of the tree: one-way imports, no Pallas on `import jaxinfer`, files of readable size.

The import graph is read from the source with `ast` (module-level imports only, `TYPE_CHECKING`
blocks excluded). Importing `a.b.c` runs the `__init__` of `a.b` first, so such an import is an
edge to `a.b` too, except to a package that encloses the importing module (it is always being
initialised already). A known edge of a file another change is rewriting sits in an allow-list,
so a new cycle still fails; file sizes have the same kind of list, with today's line counts, so
those files can only shrink.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "pallas_kernels")

# Module-level import edges that close a cycle, in files owned by other open changes. Remove an
# entry when its cycle goes; never add one for a new file.
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()

# Function-level imports of project modules that are allowed, with why (none may break a cycle).
ALLOWED_LOCAL_IMPORTS = {
    # The Pallas backend loads only when a "pallas" backend is used (no cycle: ops.pallas
    # imports only qtensor and pallas_kernels).
    ("jaxinfer.ops.linear", "jaxinfer.ops.pallas"),
    ("jaxinfer.ops.attention", "jaxinfer.ops.pallas"),
    # A kernel package loads its kernel.py (and Pallas) on first use of a kernel name.
    ("pallas_kernels.int4_matmul", "pallas_kernels.int4_matmul.kernel"),
    ("pallas_kernels.int8_matmul", "pallas_kernels.int8_matmul.kernel"),
    ("pallas_kernels.paged_attention", "pallas_kernels.paged_attention.kernel"),
}

# Files over the limit today, with their line counts: they may shrink, never grow.
MAX_LINES = {"jaxinfer": 500, "pallas_kernels": 500, "experiments": 700, "tests": 700}
OVERSIZED: dict[str, int] = {}


def _module_files() -> dict[str, pathlib.Path]:
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _is_package(name: str, files: dict) -> bool:
    return files.get(name, pathlib.Path()).name == "__init__.py"


def _resolve(node: ast.ImportFrom, module: str, files: dict) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, files):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.Module, module: str, files: dict, local: bool):
    """(target module, line) of each project import; `local`: inside functions instead."""

    def walk(body, in_function):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import | ast.ImportFrom) and in_function == local:
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    base = _resolve(node, module, files)
                    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                    names_only = len(subs) < len(node.names)
                    targets = subs + ([base] if names_only or not subs else [])
                for target in targets:
                    if target.split(".")[0] in PACKAGES:
                        yield target, node.lineno
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                    yield from walk(children, inner)

    yield from walk(tree.body, False)


def _edges(target: str, module: str, files: dict) -> list[str]:
    """The modules `import target` runs: its enclosing packages, then itself."""
    parts = target.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in files or name == module:
            continue
        encloses = module.startswith(name + ".")
        if encloses and i < len(parts):
            continue  # an enclosing package runs before `module` does
        out.append(name)
    return out


def import_graph(local: bool = False) -> dict[str, dict[str, int]]:
    files = _module_files()
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {}
        for target, line in _imports(tree, module, files, local):
            for dep in _edges(target, module, files):
                graph[module].setdefault(dep, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]], allowed: set) -> list[str] | None:
    """A cycle of `graph` (modules in order, first repeated at the end), or None."""
    state = {}  # module -> 1 on the stack, 2 done
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, {})):
            if (node, dep) in allowed:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_cycles():
    graph = import_graph()
    cycle = find_cycle(graph, ALLOWED_CYCLE_EDGES)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle:\n  " + "\n  ".join(steps))
    stale = {e for e in ALLOWED_CYCLE_EDGES if e[1] not in graph.get(e[0], {})}
    assert not stale, f"allow-listed edges no longer in the graph: {sorted(stale)}"


def test_no_function_level_imports_break_cycles():
    local = import_graph(local=True)
    found = {(m, dep) for m, deps in local.items() for dep in deps}
    unexpected = found - ALLOWED_LOCAL_IMPORTS
    assert not unexpected, f"function-level imports of project modules: {sorted(unexpected)}"
    module_level = import_graph()
    for module, dep in ALLOWED_LOCAL_IMPORTS & found:
        # With the deferred import made module-level, the graph must stay acyclic.
        graph = {m: dict(d) for m, d in module_level.items()}
        graph[module][dep] = 0
        assert find_cycle(graph, ALLOWED_CYCLE_EDGES) is None, (module, dep)


def test_cycle_finder_reports_a_cycle():  # negative control for the two tests above
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph, set()) == ["a", "b", "c", "a"]
    assert find_cycle(graph, {("c", "a")}) is None


def test_graph_sees_package_init_edges():
    graph = import_graph()
    assert "jaxinfer.qtensor" in graph["jaxinfer.ops.linear"]
    # `from pallas_kernels.int4_matmul.reference import ...` runs the package __init__ first.
    assert "pallas_kernels.int4_matmul" in graph["jaxinfer.qtensor"]
    assert not any(dep.startswith("jaxinfer") for dep in graph["pallas_kernels.tiling"])


def test_engine_and_speculative_do_not_import_generate():
    # One request path (jaxinfer.requests): `ji.generate` is a peer of the speculative loop and
    # the engine, not their library.
    graph = import_graph()
    users = sorted(
        module
        for module, deps in graph.items()
        if module.startswith(("jaxinfer.engine", "jaxinfer.speculative"))
        and "jaxinfer.generate" in deps
    )
    assert not users, f"import jaxinfer.generate: {users}"
    assert "jaxinfer.requests" in graph["jaxinfer.engine.engine"]  # the walk sees the new path
    assert "jaxinfer.requests" in graph["jaxinfer.speculative.loop"]


def test_pallas_kernels_never_imports_jaxinfer():
    for module, deps in import_graph().items():
        if module.startswith("pallas_kernels"):
            assert not [d for d in deps if d.startswith("jaxinfer")], module


def test_import_jaxinfer_loads_no_pallas_or_triton():
    # `import jax` itself loads jaxlib.gpu_triton (jaxlib's plugin registry, not Pallas), so
    # Triton is judged on what `import jaxinfer` adds to it; Pallas on everything loaded.
    code = (
        "import sys, jax; before = set(sys.modules); import jaxinfer; "
        "print(sorted(m for m in sys.modules if 'pallas.' in m + '.' and 'pallas_kernels' not in m"
        " or 'triton' in m and m not in before))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("top", sorted(MAX_LINES))
def test_files_are_short(top):
    too_long = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        if n > OVERSIZED.get(rel, MAX_LINES[top]):
            too_long[rel] = n
    assert not too_long, f"over {MAX_LINES[top]} lines (or grown past their entry): {too_long}"
