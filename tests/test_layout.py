"""The package's shape: no import circles, and no module outside engine/ reaching into its private names."""

import ast
import pathlib
import re

import dsaserve

ROOT = pathlib.Path(dsaserve.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("dsaserve",) + path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports anywhere (lazy imports inside functions included).
    `from pkg import sub` is an edge to pkg.sub when sub is a module, else to pkg."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsaserve"):
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_circles():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


PRIVATE_ENGINE_ACCESS = re.compile(r"\b(engine|scheduler|runner|output_processor|kv)\._[a-z]")


def test_nothing_outside_engine_uses_a_private_engine_name():
    offenders = []
    for name, path in modules().items():
        if name.startswith("dsaserve.engine.") or name == "dsaserve.engine":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsaserve.engine"):
                offenders += [f"{name} imports {a.name}" for a in node.names if a.name.startswith("_")]
        offenders += [f"{name}: {m.group(0)}" for m in PRIVATE_ENGINE_ACCESS.finditer(source)]
    assert offenders == []
