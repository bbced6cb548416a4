"""The package's shape: packages in one order (none imports one above it), no import circles, and no module reaching
into another's private names."""

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


# Bottom to top. A module imports only from its own unit (a subpackage, or a module at the top of dsaserve) or from
# units in lower layers; units in the same layer do not import each other.
LAYERS = (
    ("model_family", "hybrid_config", "byte_sizes"),
    ("config", "device", "outputs", "speculative_config", "cuda_graph_sizes", "chat_template", "tokenizer",
     "prepared_calls"),
    ("native", "triton_ops", "deepseek_v32_chat"),
    ("quantization", "distributed", "structured_output", "chat_format"),
    ("attention", "sampling_params"),
    ("model", "sampling"),
    ("engine_args", "demo", "parallel_plan"),
    ("engine",),
    ("server", "llm", "doctor"),
    ("bench", "dsaserve"),  # dsaserve: the package's own __init__ (the public surface)
    ("cli",),
    ("__main__",),
)


def unit_of(module: str) -> str:
    """dsaserve.model.mla → model; dsaserve.config → config; dsaserve → dsaserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import that reaches a unit in the same layer or one above, as 'a → b'."""
    layer_of = {unit: i for i, units in enumerate(layers) for unit in units}
    found = []
    for module, targets in graph.items():
        for target in targets:
            a, b = unit_of(module), unit_of(target)
            if a != b and layer_of[b] >= layer_of[a]:
                found.append(f"{module} → {target} ({a} is in layer {layer_of[a]}, {b} in layer {layer_of[b]})")
    return sorted(found)


def test_every_unit_has_a_layer():
    units = {unit_of(module) for module in modules()}
    assert units == {unit for layer in LAYERS for unit in layer}


def test_no_package_imports_one_above_it():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"dsaserve.model.mla": {"dsaserve.attention.sparse", "dsaserve.engine.llm_engine"},
             "dsaserve.quantization.apply": {"dsaserve.quantization.formats", "dsaserve.distributed.sharding"}}
    assert upward_imports(graph) == [
        "dsaserve.model.mla → dsaserve.engine.llm_engine (model is in layer 5, engine in layer 7)",
        "dsaserve.quantization.apply → dsaserve.distributed.sharding (quantization is in layer 3, distributed in "
        "layer 3)"]


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


def private_reads(sources: dict[str, str]) -> list[str]:
    """Reads of a private name the package defines (`_x`: a function, class, module global or attribute) on
    anything but self, cls or super(): another object's or another module's internals."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            name = (node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                    node.attr if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) else
                    node.id if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else "")
            if name.startswith("_") and not name.startswith("__"):
                defined.add(name)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in defined):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_objects_private_names():
    assert private_reads({name: path.read_text() for name, path in modules().items()}) == []


def test_the_private_check_finds_a_read_of_another_objects_internals():
    sources = {"a": "class A:\n    def __init__(self):\n        self._calls = {}\n"
                    "    def _gather(self):\n        pass\n",
               "b": "def use(a):\n    a._gather()\n    return a._calls, a.public\n"}
    assert private_reads(sources) == ["b:2: a._gather", "b:3: a._calls"]
