"""The package layout: imports only point downward.

The import graph of ``treedec/`` is read from the source (every ``import``, module-level or inside a
function, since a lazy import is still a dependency), and checked for

* cycles among treedec modules (a cycle means two modules are one, split in two files), and among its
  packages (``treedec.tree``, ``treedec.models``, ... and top-level modules): layers only point down;
* library layers importing entry points (``python -m`` modules, ``treedec.bench``), or the data layer
  importing the training, decoding or tree layers above it.

``python tests/test_layout.py`` prints the cycles and the package-level edges.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "treedec"
ENTRY_POINTS = ("treedec.train", "treedec.pretrain", "treedec.generate", "treedec.calibrate", "treedec.export_head",
                "treedec.regenerate", "treedec.sweep", "treedec.bench")
LIBRARY = ("treedec.data", "treedec.models", "treedec.attention", "treedec.tree", "treedec.decoding",
           "treedec.training")


def _name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the treedec modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    files = {_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in files:
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    deps.add(n)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _edges(graph, src, dst) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() if _under(a, src) for b in bs if _under(b, dst))


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "treedec" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "treedec" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from treedec.sub.b import g\n")
    (pkg / "b.py").write_text("from .a import f\nimport os\n")
    g = import_graph(tmp_path / "treedec")
    assert g["treedec.sub.a"] == {"treedec.sub.b"} and g["treedec.sub.b"] == {"treedec.sub.a"}
    assert cycles(g) == [frozenset({"treedec.sub.a", "treedec.sub.b"})]


def packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between treedec's packages and top-level modules (``treedec.tree.policies.auto`` -> ``treedec.tree``)."""
    top = lambda m: ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {top(m): set() for m in graph if m != "treedec"}
    for a, bs in graph.items():
        if a != "treedec":
            out[top(a)] |= {top(b) for b in bs if b != "treedec" and top(b) != top(a)}
    return out


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_packages_import_only_downward(graph):
    """The package-level graph, lazy imports included, has no cycle."""
    g = packages(graph)
    found = cycles(g)
    assert not found, "package cycles: " + "; ".join(
        " <-> ".join(sorted(c)) + " (" + ", ".join(_edges({a: g[a] & c for a in c}, tuple(c), tuple(c))) + ")"
        for c in found)


def test_the_library_never_imports_an_entry_point(graph):
    assert _edges(graph, LIBRARY, ENTRY_POINTS) == []


def test_the_config_layer_sits_above_the_library_it_checks(graph):
    """treedec.config imports the trees, heads and models to run their own rules; none of them imports it back."""
    below = ("treedec.data", "treedec.models", "treedec.heads", "treedec.attention", "treedec.tree", "treedec.decoding",
             "treedec.probe", "treedec.errors", "treedec.sampling")
    assert _edges(graph, below, ("treedec.config",)) == []
    assert _edges(graph, ("treedec.config",), ("treedec.training", "treedec.bench", "treedec.cli", *ENTRY_POINTS)) == []


def test_the_data_layer_sits_below_training_decoding_and_trees(graph):
    assert _edges(graph, ("treedec.data",), ("treedec.training", "treedec.decoding", "treedec.tree",
                                             "treedec.attention", "treedec.config", "treedec.cli")) == []


if __name__ == "__main__":
    g = import_graph()
    for c in cycles(g) + cycles(packages(g)):
        print("cycle:", " <-> ".join(sorted(c)))
        for e in _edges({a: g.get(a, set()) & c for a in c}, tuple(c), tuple(c)):
            print("   ", e)
    top = lambda m: ".".join(m.split(".")[:2])
    pairs = sorted({(top(a), top(b)) for a, bs in g.items() for b in bs if top(a) != top(b)})
    print("\n".join(f"{a} -> {b}" for a, b in pairs))
