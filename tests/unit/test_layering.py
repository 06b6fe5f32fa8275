"""The package's import graph: no cycle, and no module importing from a layer above its own.

The graph is read from the source (``ast``) of every module under ``fsdpcheck/``, nothing
imported. An edge is an ``import`` or ``from ... import`` of an fsdpcheck module:

- at module level, or inside a function (a lazy import runs too, only later: importing lazily
  defers a cost, torch.distributed.checkpoint or an optional library, and never breaks a
  cycle, so it is an edge like any other);
- under ``if TYPE_CHECKING:``: never run, so left out of the cycle check (annotations may name
  each other's types), but held to the layers like any import;
- ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to ``a.b``;
- importing ``a.b.c`` runs the ``__init__.py`` of ``a`` and ``a.b`` first, so for the cycle
  check it is an edge to those packages too (not for the layers: a package's ``__init__`` is
  where its modules' names live);
- a package that imports its own modules by discovery (``pkgutil.iter_modules``:
  ``fsdpcheck.formats`` finds its layouts) has an edge to each of them.

Modules named by a string and imported with ``importlib`` (the package's lazy public names,
``offline_dist``'s job factories, a user's conversion module) are not import statements and
are not drawn.

The layers are the numbered list under "## Layers" in docs/architecture.md: every module is in
one of them (a folder there covers every module under it), the package's ``__init__.py`` above
all of them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import fsdpcheck

PACKAGE = Path(fsdpcheck.__file__).parent
ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TOP = 10**6  # the package's own __init__.py: above every layer

#: Edges left out of the cycle check, each with the reason it stays. An entry no longer in the
#: graph fails `test_each_allowed_edge_is_still_there`.
CYCLE_ALLOWED: dict[tuple[str, str], str] = {}
#: Imports from a higher layer, each with the reason it stays (none today).
LAYER_ALLOWED: dict[tuple[str, str], str] = {}
#: Packages that import every module of their own by discovery (checked against the source).
DISCOVERS = {"fsdpcheck.formats"}


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target` at `line` ("top", "lazy" or "typing")."""

    source: str
    target: str
    line: int
    kind: str

    def where(self) -> str:
        path = MODULES[self.source].relative_to(ROOT)
        return f"{self.source} imports {self.target} ({path}:{self.line}, {self.kind})"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The longest fsdpcheck module that `name` names or lies inside, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The fsdpcheck imports of one module, with where and how they happen."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.is_package = MODULES[module].name == "__init__.py"
        self.functions = 0
        self.typing = 0
        self.edges: list[Edge] = []
        self.discovers = False

    def _kind(self) -> str:
        return "typing" if self.typing else "lazy" if self.functions else "top"

    def _add(self, target: str | None, line: int) -> None:
        if target is not None and target != self.module:
            self.edges.append(Edge(self.module, target, line, self._kind()))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.typing += 1
        for child in node.body:
            self.visit(child)
        self.typing -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "iter_modules":
            self.discovers = True
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "fsdpcheck" or alias.name.startswith("fsdpcheck."):
                self._add(_known(alias.name), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # relative: from the package this module is in (or above)
            base = self.module.split(".")
            if not self.is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            name = ".".join([*base, *([node.module] if node.module else [])])
        else:
            name = node.module or ""
        if name != "fsdpcheck" and not name.startswith("fsdpcheck."):
            return
        for alias in node.names:
            sub = f"{name}.{alias.name}"
            self._add(sub if sub in MODULES else _known(name), node.lineno)


def _read() -> tuple[list[Edge], set[str]]:
    edges: list[Edge] = []
    discovering: set[str] = set()
    for module, path in MODULES.items():
        visitor = _Imports(module)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges += visitor.edges
        if visitor.discovers:
            discovering.add(module)
    return edges, discovering


EDGES, DISCOVERING = _read()


def _runtime_graph() -> dict[str, dict[str, Edge]]:
    """What importing each module runs: target -> the edge that makes it (first one)."""
    graph: dict[str, dict[str, Edge]] = {m: {} for m in MODULES}

    def add(edge: Edge) -> None:
        if (edge.source, edge.target) not in CYCLE_ALLOWED:
            graph[edge.source].setdefault(edge.target, edge)

    for e in EDGES:
        if e.kind == "typing":
            continue
        add(e)
        parts = e.target.split(".")
        for i in range(1, len(parts)):  # the packages whose __init__ runs first
            package = ".".join(parts[:i])
            if package in MODULES and not (e.source + ".").startswith(package + "."):
                add(Edge(e.source, package, e.line, f"{e.kind}, runs {package}'s __init__"))
    for package in DISCOVERS:
        for m in MODULES:
            if m.rpartition(".")[0] == package:
                add(Edge(package, m, 0, "discovered"))
    return graph


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _one_cycle(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[Edge]:
    """A shortest cycle through the first module of `component`, as its edges."""
    inside = set(component)
    start = component[0]
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, edge in sorted(graph[v].items()):
                if w not in inside or w in came:
                    continue
                came[w] = edge
                if w == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")  # pragma: no cover


def _layers() -> tuple[dict[str, int], list[str]]:
    """Module or folder prefix -> its layer, from docs/architecture.md; and stale names."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    prefixes: dict[str, int] = {}
    stale: list[str] = []
    for number, body in re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section, re.S | re.M):
        for name in re.findall(r"`([^`]+)`", body):
            if name.endswith(".py") and name != "__init__.py":
                module = "fsdpcheck." + name[: -len(".py")].replace("/", ".")
            elif name.endswith("/") and not name.startswith("csrc"):
                module = "fsdpcheck." + name.rstrip("/").replace("/", ".")
            else:
                continue
            if module not in MODULES:
                stale.append(name)
            prefixes[module] = int(number)
    return prefixes, stale


LAYERS, STALE = _layers()


def _layer(module: str) -> int | None:
    if module == "fsdpcheck":
        return TOP
    probe: str | None = module
    while probe:
        if probe in LAYERS:
            return LAYERS[probe]
        probe = probe.rpartition(".")[0]
    return None


# ---------------------------------------------------------------------------------------------
def test_the_graph_reader_sees_every_kind_of_import():
    """Known edges of each kind are found, so that the checks below cannot pass on nothing."""
    found = {(e.source, e.target, e.kind) for e in EDGES}
    assert ("fsdpcheck.live", "fsdpcheck.layout", "top") in found
    assert ("fsdpcheck.formats.readers", "fsdpcheck.sources.dcp.source", "lazy") in found
    assert ("fsdpcheck.formats.base", "fsdpcheck.sources.base", "typing") in found
    assert ("fsdpcheck.comparison", "fsdpcheck.offline_dist", "top") in found  # from x import m
    assert len(MODULES) > 80 and len(EDGES) > 300


def test_the_cycle_finder_names_a_cycle():
    a, b, c = (Edge("fsdpcheck.a", "fsdpcheck.b", 1, "top"), Edge("fsdpcheck.b", "fsdpcheck.c", 2,
               "lazy"), Edge("fsdpcheck.c", "fsdpcheck.a", 3, "top"))  # fmt: skip
    graph = {"fsdpcheck.a": {"fsdpcheck.b": a}, "fsdpcheck.b": {"fsdpcheck.c": b},
             "fsdpcheck.c": {"fsdpcheck.a": c}, "fsdpcheck.d": {"fsdpcheck.a": a}}  # fmt: skip
    components = _cycles(graph)
    assert components == [["fsdpcheck.a", "fsdpcheck.b", "fsdpcheck.c"]]
    assert _one_cycle(graph, components[0]) == [a, b, c]


def test_the_discovering_packages_are_the_ones_listed():
    assert DISCOVERING == DISCOVERS


def test_the_import_graph_has_no_cycle():
    graph = _runtime_graph()
    cycles = []
    for component in _cycles(graph):
        path = _one_cycle(graph, component)
        steps = "\n    ".join(
            f"{e.where() if e.line else f'{e.source} discovers {e.target}'}" for e in path
        )
        cycles.append(f"{len(component)} modules in a cycle ({', '.join(component)}), e.g.:\n"
                      f"    {steps}")  # fmt: skip
    assert not cycles, "import cycles (move the shared piece into a lower module):\n" + "\n".join(
        cycles
    )


def test_every_module_has_a_layer_and_every_layer_name_a_module():
    assert not STALE, f"docs/architecture.md's Layers names what is not in fsdpcheck/: {STALE}"
    missing = sorted(m for m in MODULES if _layer(m) is None)
    assert not missing, f"modules in no layer of docs/architecture.md (add them there): {missing}"


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for e in EDGES:
        source, target = _layer(e.source), _layer(e.target)
        assert source is not None and target is not None
        if target > source and (e.source, e.target) not in LAYER_ALLOWED:
            above = "the package's __init__" if target == TOP else f"layer {target}"
            upward.append(f"{e.where()}: layer {source} imports from {above}")
    assert not upward, "imports from a higher layer (docs/architecture.md):\n" + "\n".join(upward)


def test_each_allowed_edge_is_still_there() -> None:
    gone = [
        a
        for a in (*CYCLE_ALLOWED, *LAYER_ALLOWED)
        if not any((e.source, e.target) == a for e in EDGES)
    ]
    assert not gone, f"{gone} no longer in the import graph: drop them from the allowlists"
