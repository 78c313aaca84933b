"""Which module may reach which: the layering of the project's code that users and maintainers
rely on, read from the sources with `ast` (one test per rule, each with a test that the check
sees what it must):

- no import circle inside `megatron_ext`;
- imports go down the package's layers (`LAYERS`, the order of docs/architecture.md's module
  table), with no circle between its subpackages;
- imports sit at module level, but optional dependencies and deferred imports that keep a slow
  package out of a light module (the tools' entry modules do not load megatron-core, the data
  tools not even torch), each with a comment;
- inference/, conversion/ and checkpoint/ read checkpoints without going through training/;
- megatron-core is first imported through `megatron_ext.megatron_import` (the gate that defers
  its import-time `torch.compile`s), everywhere in the project's code;
- the core reaches the CPU accelerations only through `megatron_ext.cpu_accel`'s accessors;
- library code gets its process groups passed in: only `megatron_ext/parallel.py` reads
  megatron's `parallel_state`.

Every `import` / `from ... import` counts, at module level and inside functions (a
function-local import that closes a circle only hides it). Imports under
`if TYPE_CHECKING:` never run and are left out of the import graph.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_ext"

# The circles still to break; this set may only shrink (see the test's message).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules(roots: tuple[pathlib.Path, ...] = (PACKAGE,)) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module under ``roots`` (directories of the repository)."""
    mods = {}
    for path in (path for root in roots for path in root.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module_level: bool = False):
    """Every Import/ImportFrom node of `tree`, except those under `if TYPE_CHECKING:`; with
    `module_level`, only those that run when the module is imported (none inside functions)."""
    for node in ast.iter_child_nodes(tree):
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child, module_level))
            continue
        yield from _imports_of(node, module_level)


def _imports_of(node: ast.AST, module_level: bool):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node, module_level)


def import_graph() -> dict[str, set[str]]:
    """module -> the megatron_ext modules it imports (a package counts as its __init__)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for target in targets:
                found = owner(target)
                if found and found != module and found.startswith("megatron_ext"):
                    graph[module].add(found)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The circles of `graph`: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # A module-level import inside the package.
    assert "megatron_ext.training.megatron_engine" in graph["megatron_ext.training.run"]
    # Module-level imports across subpackages.
    assert "megatron_ext.config.run" in graph["megatron_ext.config.arguments"]
    # A planted circle is found.
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(planted) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles_in_the_package():
    cycles = set(strongly_connected(import_graph()))
    new = cycles - KNOWN_CYCLES
    assert not new, "import circles in megatron_ext: " + "; ".join(
        " <-> ".join(sorted(c)) for c in new
    )
    fixed = KNOWN_CYCLES - cycles
    assert not fixed, f"no longer circular, drop from KNOWN_CYCLES: {sorted(map(sorted, fixed))}"


# The package's layers, lowest first: a module imports only from its own unit and from the
# layers before it, so units of one layer do not import each other. A unit is a subpackage or a
# top-level module (`__init__`: the package itself); a module named here (cpu_accel's lean
# decode step, which is built of models/ parts and loaded by name) is a unit of its own.
# docs/architecture.md's "Where things live" lists the modules in this order.
LAYERS: list[tuple[str, ...]] = [
    ("config",),
    ("__init__", "_lazy", "_paths", "_signals", "megatron_import", "placement", "elastic"),
    ("launch", "rng"),
    ("parallel",),
    ("cli", "cpu_accel"),
    ("data", "tensor_parallel"),
    ("lev",),
    ("models",),
    ("checkpoint", "cpu_accel.lean_decode"),
    ("inference",),
    ("training",),
    ("conversion", "evaluation"),
    ("gpu_check", "quickstart"),
]
# Upward imports known (none since the config room is the lowest layer). This set may only
# shrink; an entry whose module is gone (moved) no longer counts.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def unit_of(module: str, layers=LAYERS) -> str:
    """The unit of a dotted megatron_ext module: the longest unit of `layers` that holds it,
    else its subpackage or top-level module."""
    name = module.partition(".")[2] or "__init__"
    named = [u for layer in layers for u in layer if name == u or name.startswith(u + ".")]
    return max(named, key=len) if named else name.split(".")[0]


def layer_breaks(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """The imports of `graph` from a unit to one of its own layer or a higher one."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if unit_of(module, layers) != unit_of(target, layers)
        and level[unit_of(module, layers)] <= level[unit_of(target, layers)]
    )


def unit_graph(graph: dict[str, set[str]], layers=LAYERS) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {unit_of(m, layers): set() for m in graph}
    for module, targets in graph.items():
        units[unit_of(module, layers)] |= {unit_of(t, layers) for t in targets}
    return {unit: targets - {unit} for unit, targets in units.items()}


def test_the_layer_check_sees_what_it_must():
    layers = [("low",), ("mid", "side", "mid.top"), ("high",)]
    graph = {
        "megatron_ext.mid.a": {"megatron_ext.low", "megatron_ext.mid.b", "megatron_ext.high.x"},
        "megatron_ext.mid.b": {"megatron_ext.side"},
        "megatron_ext.mid.top.c": {"megatron_ext.mid.a"},
        "megatron_ext.high.x": {"megatron_ext.mid.top.c"},
        "megatron_ext.low": set(), "megatron_ext.side": set(),
    }  # fmt: skip
    assert unit_of("megatron_ext.mid.top.c", layers) == "mid.top"
    assert unit_of("megatron_ext", LAYERS) == "__init__"
    assert layer_breaks(graph, layers) == [
        ("megatron_ext.mid.a", "megatron_ext.high.x"),
        ("megatron_ext.mid.b", "megatron_ext.side"),
        ("megatron_ext.mid.top.c", "megatron_ext.mid.a"),
    ]
    assert strongly_connected(unit_graph(graph, layers)) == [frozenset({"high", "mid", "mid.top"})]


def test_imports_go_down_the_layers():
    graph = import_graph()
    placed = {unit for layer in LAYERS for unit in layer}
    unplaced = {unit_of(module) for module in graph} - placed
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {sorted(unplaced)}"
    assert len(placed) == sum(map(len, LAYERS)), "a unit is in LAYERS twice"
    gone = placed - {unit_of(module) for module in graph}
    assert not gone, f"drop from LAYERS (no such module): {sorted(gone)}"
    known = {edge for edge in KNOWN_UPWARD if set(edge) <= set(graph)}
    breaks = layer_breaks(graph)
    assert [edge for edge in breaks if edge not in known] == [], (
        "imports from a lower layer to a higher one (or between units of one layer): move the "
        "code, or the unit in LAYERS and in docs/architecture.md"
    )
    assert known <= set(breaks), f"no longer upward, drop from KNOWN_UPWARD: {known - set(breaks)}"
    graph = {m: {t for t in ts if (m, t) not in known} for m, ts in graph.items()}
    assert strongly_connected(unit_graph(graph)) == []


def test_the_module_table_reads_in_layer_order():
    """docs/architecture.md's "Where things live" lists the modules lowest layer first."""
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("\n## Where things live") :].split("\n## ")[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    order = []
    for row in rows:
        for path in re.findall(r"`([^`]+\.py)`", row):
            module = ".".join(["megatron_ext", *path.removesuffix(".py").split("/")])
            unit = unit_of(module.removesuffix(".__init__"))
            order.append((level[unit], path))
    assert len(order) > 90
    out_of_order = [f"{b[1]} after {a[1]}" for a, b in zip(order, order[1:]) if b[0] < a[0]]
    assert not out_of_order, "modules listed after a higher layer's: " + ", ".join(out_of_order)


# Packages that need not be installed (extras, or a GPU stack): imported inside the function
# that needs them, with a comment saying so, so that the rest runs without them.
OPTIONAL_PACKAGES = {
    "transformer_engine", "triton", "lm_eval", "transformers", "wandb", "safetensors",
    "huggingface_hub", "tokenizers", "accelerate",
}  # fmt: skip
# megatron-core modules that import Transformer Engine.
OPTIONAL_MEGATRON_MODULES = ("megatron.core.extensions.transformer_engine",)


def _says_why(line: str) -> bool:
    """Whether `line` holds a comment other than a linter's or formatter's pragma."""
    pragmas = ("noqa", "type:", "fmt:", "pragma")
    return any(c.strip() and not c.strip().startswith(pragmas) for c in line.split("#")[1:])


def function_local_imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, top-level package, commented) of every import inside a function of `path`; a
    relative import is megatron_ext's. `commented`: a comment on the import's line or on the
    line above its block of imports (blank lines between its isort sections included)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    # The rows of every import statement (a multi-line one spans several).
    import_rows = {
        row
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for row in range(node.lineno - 1, node.end_lineno)
    }
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                package = "megatron_ext"
            else:
                name = node.names[0].name if isinstance(node, ast.Import) else node.module
                package = name.split(".")[0]
            row = node.lineno - 1
            commented = _says_why(lines[row])
            while not commented and row > 0:
                row -= 1
                text = lines[row].strip()
                commented = _says_why(text) and (text.startswith("#") or row in import_rows)
                # A blank line between import sections (isort's) stays inside the block.
                between = not text and row - 1 in import_rows
                if not (commented or row in import_rows or between):
                    break
            found.append((node.lineno, package, commented))
    return sorted(set(found))


# What a deferred import may keep out of a module's import: packages that take seconds, and
# slow torch submodules torch's own import leaves out (torch.distributed.optim TorchScript-
# compiles its functional optimizers when imported; torch.distributed.pipelining imports
# TorchDynamo).
HEAVY = {"torch", "megatron", "matplotlib", "tensorboard"}
HEAVY_SUBMODULES = ("torch.distributed.optim", "torch.distributed.pipelining")


@functools.lru_cache(maxsize=2)
def module_level_closure(roots: tuple[pathlib.Path, ...] = (PACKAGE,)) -> dict[str, set[str]]:
    """module -> every package and megatron_ext module importing it loads (module-level
    imports only, followed through megatron_ext and the other modules under ``roots``;
    importing `a.b.c` runs `a` and `a.b` too). `megatron` counts as `torch` as well
    (megatron.core imports it)."""
    mods = _modules(roots)
    direct: dict[str, set[str]] = {}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), module_level=True):
            for target in _targets(node, package, mods):
                ours = target in mods or target.startswith("megatron_ext")
                found.add(target if ours else target.split(".")[0])
        direct[module] = found
    closure: dict[str, set[str]] = {}

    def close(module: str) -> set[str]:
        if module not in closure:
            closure[module] = set()
            seen = set(direct.get(module, ()))
            parts = module.split(".")
            seen.update(".".join(parts[:i]) for i in range(1, len(parts)))
            for target in list(seen):
                if target in mods and target != module:
                    seen |= close(target)
            if "megatron" in seen:
                seen.add("torch")
            closure[module] = seen
        return closure[module]

    for module in mods:
        close(module)
    return closure


def _targets(node, package: str, mods) -> list[str]:
    """The dotted names an import node loads (a megatron_ext module where one is named)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    lazy = _lazy_exports(base, mods)
    names = [
        f"{base}.{a.name}" if f"{base}.{a.name}" in mods else lazy.get(a.name, base)
        for a in node.names
    ]
    if base.startswith("megatron_ext"):
        owner = base
        while owner and owner not in mods:
            owner = owner.rpartition(".")[0]
        names = [n if n in mods else owner for n in names]
    return names


def _lazy_exports(package: str, mods) -> dict[str, str]:
    """name -> module of a package's lazy exports (its `_LAZY` table, megatron_ext/_lazy.py):
    importing such a name runs that module."""
    path = mods.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


def test_function_local_imports_are_optional_or_keep_their_module_light():
    """A function-local import hides a circle or a slow import. Only two kinds may stay, each
    with a comment saying why: an optional dependency, and a deferred import that keeps a slow
    package (HEAVY) out of its module's import (tools' --help, the data tools without torch)."""
    mods = _modules()
    by_path = {path: module for module, path in mods.items()}
    closure = module_level_closure()
    uncommented, needless = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        module = by_path[path]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        nodes = {
            node.lineno: node
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        for line, top, commented in function_local_imports(path):
            if not commented:
                uncommented.append(f"{rel}:{line}")
            if top in OPTIONAL_PACKAGES:
                continue
            slow = HEAVY | OPTIONAL_PACKAGES
            loads = set()
            for target in _targets(nodes[line], package, mods):
                if target in closure:
                    loads |= closure[target] & slow
                elif target.startswith(OPTIONAL_MEGATRON_MODULES):
                    loads.add("transformer_engine")
                elif target.startswith(HEAVY_SUBMODULES):
                    loads.add(target)
                elif target.split(".")[0] in slow:
                    loads |= {target.split(".")[0]} | ({"torch"} if top == "megatron" else set())
            if not loads - closure[module]:
                needless.append(f"{rel}:{line}")
    assert not needless, (
        "function-local imports that keep nothing slow out of their module's import: move them "
        "to module level (only optional packages and deferred "
        + "/".join(sorted(HEAVY))
        + " imports stay inside functions): "
        + ", ".join(needless)
    )
    assert not uncommented, (
        "imports inside functions need a comment saying why (optional dependency, or what the "
        "deferral keeps out of the module's import): " + ", ".join(uncommented)
    )


def test_the_light_modules_stay_light():
    """What the deferred imports buy, checked statically: the tools' entry modules do not load
    megatron.core at import (their --help is fast), the data tools not even torch."""
    closure = module_level_closure()
    for module in (
        "megatron_ext.evaluation.evaluate", "megatron_ext.inference.generate",
        "megatron_ext.conversion.convert_checkpoint", "megatron_ext.quickstart",
        "megatron_ext.cli",
    ):  # fmt: skip
        assert "megatron" not in closure[module], module
    for module in ("megatron_ext.data.preprocess_data", "megatron_ext.data.train_tokenizer"):
        assert not closure[module] & HEAVY, (module, closure[module] & HEAVY)
    # The closure sees through packages, relative imports and lazy exports.
    assert _lazy_exports("megatron_ext.models", _modules())["build_model"] == (
        "megatron_ext.models.builder"
    )
    assert "torch" in closure["megatron_ext.training.loop"]
    assert "megatron" in closure["megatron_ext.parallel"]


def test_function_local_import_check_sees_what_it_must(tmp_path):
    planted = tmp_path / "mod.py"
    planted.write_text(
        "def f():\n"
        "    from . import sibling\n"
        "    import torch\n"
        "    # optional: the [wandb] extra\n"
        "    import wandb\n"
        "    import transformers\n"
        "def g():\n"
        "    x = 1\n"
        "    import lm_eval\n"
        "def h():\n"
        "    import numpy  # noqa: F401\n"
    )  # fmt: skip
    assert function_local_imports(planted) == [
        (2, "megatron_ext", False), (3, "torch", False), (5, "wandb", True),
        (6, "transformers", True), (9, "lm_eval", False), (11, "numpy", False),
    ]  # fmt: skip


# Issue 57 asks for at most 40 function-local imports in the whole package (optional
# dependencies, deferred slow imports, each with its reason); this bound may only go down.
MAX_FUNCTION_LOCAL_IMPORTS = 27


def test_function_local_imports_are_few():
    count = sum(len(function_local_imports(path)) for path in PACKAGE.rglob("*.py"))
    assert count <= MAX_FUNCTION_LOCAL_IMPORTS, (
        f"{count} imports inside functions, at most {MAX_FUNCTION_LOCAL_IMPORTS}: import at "
        "module level, or defer one import of a module that imports the rest"
    )


def test_reading_a_checkpoint_does_not_go_through_training():
    """inference/, conversion/ and checkpoint/ read checkpoints through `megatron_ext.checkpoint`
    and the configs (`megatron_ext.config`), never through training/."""
    graph = import_graph()
    through_training = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.split(".")[1:2] in (["inference"], ["conversion"], ["checkpoint"])
        for target in targets
        if target.startswith("megatron_ext.training")
    )
    assert through_training == []


# megatron-core's first import: the gate, and the roots whose module-level imports the check
# follows (tests.support.distributed imports the gate for the test files that import it).
GATE = "megatron_ext.megatron_import"
ROOTS = (PACKAGE, REPO / "tests" / "support")
# Where the project's code lives: every import of megatron there must come after the gate.
CHECKED = ("megatron_ext", "tools", "benchmarks", "tests", "pretrain_leviathan.py")


def _files():
    for name in CHECKED:
        path = REPO / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _gates(node, package: str, mods, closure) -> bool:
    """Whether running `node` (an import) imports the gate: names it, or a megatron_ext module
    whose module-level imports do."""
    for target in _targets(node, package, mods):
        if target == GATE or GATE in closure.get(target, ()):
            return True
    return False


def _is_megatron(node) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return not getattr(node, "level", 0) and any(
        n == "megatron" or n.startswith("megatron.") for n in names
    )


def megatron_before_gate(path: pathlib.Path, root: pathlib.Path = REPO) -> list[int]:
    """Lines of `path` that import megatron before the gate has surely been imported: neither
    earlier at module level nor earlier in the same function."""
    mods = _modules(ROOTS)
    closure = module_level_closure(ROOTS)
    rel = path.relative_to(root).with_suffix("")
    module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if module == GATE:
        return []
    tree = ast.parse(path.read_text(), str(path))
    # node -> its innermost enclosing function (ast.walk is breadth-first: inner ones come later).
    scope_of = {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(fn):
            if node is not fn:
                scope_of[node] = fn
    gated_scopes: set = set()
    bad = []
    for node in _imports(tree):  # in source order
        scope = scope_of.get(node)
        if _gates(node, package, mods, closure):
            gated_scopes.add(scope)
        elif _is_megatron(node):
            enclosing, fn = {None}, scope
            while fn is not None:
                enclosing.add(fn)
                fn = scope_of.get(fn)
            if not gated_scopes & enclosing:
                bad.append(node.lineno)
    return bad


def test_the_check_sees_an_ungated_megatron_import(tmp_path):
    (tmp_path / "tool.py").write_text(
        "import os\n"
        "from megatron.core import parallel_state\n"
        "def f():\n"
        "    import megatron.core.datasets\n"
        "def g():\n"
        "    import megatron_ext.megatron_import  # gate\n"
        "    import megatron.core.datasets\n"
        "def h():\n"
        "    from megatron_ext.parallel import ProcessGroups  # imports the gate\n"
        "    from megatron.core import tensor_parallel\n"
        "def k():\n"
        "    from megatron_ext.models import ModelConfig  # does not\n"
        "    from megatron.core import tensor_parallel\n"
    )
    assert megatron_before_gate(tmp_path / "tool.py", tmp_path) == [2, 4, 13]


def test_every_megatron_import_comes_after_the_gate():
    bad = [f"{p.relative_to(REPO)}:{line}" for p in _files() for line in megatron_before_gate(p)]
    assert not bad, (
        "megatron imported before megatron_ext.megatron_import (import it first, see its "
        "docstring): " + ", ".join(bad)
    )


# The CPU accelerations: only their accessors are reached from the core.
SUBPACKAGE = PACKAGE / "cpu_accel"
PIECES = {p.stem for p in SUBPACKAGE.glob("*.py") if p.stem != "__init__"}


def _imports_of_pieces(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names.append(node.module)
        else:
            continue
        for name in names:
            parts = name.split(".")
            if "cpu_accel" in parts:
                after = parts[parts.index("cpu_accel") + 1 :]
                if after and after[0] in PIECES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_no_core_module_imports_an_acceleration_module():
    assert PIECES >= {"build", "cross_entropy", "host_memory", "lean_decode", "lev_kernel"}
    offenders = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if SUBPACKAGE not in path.parents
        for hit in _imports_of_pieces(path)
    ]
    assert offenders == []


# Process groups: library code gets them passed in. Scanned: the package, tools/ and
# benchmarks/. Not scanned: pretrain_leviathan.py, whose context-parallel helpers run inside
# Megatron's `forward_step(data_iterator, model)` contract, which carries no groups; and the
# tests, which compare against megatron's own state on purpose. megatron-core's own layers read
# their globals when a model is built without `pg`: that is megatron's code.
GROUP_READERS = {"megatron_ext/parallel.py"}
GROUP_SCANNED = ("megatron_ext", "tools", "benchmarks")
PARALLEL_STATE = "megatron.core.parallel_state"


def _global_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every use of a `parallel_state` function (`get_*`, `is_*`,
    `model_parallel_is_initialized`, ...), whatever the module or function is imported as."""
    aliases, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core":
            aliases |= {a.asname or a.name for a in node.names if a.name == "parallel_state"}
        elif isinstance(node, ast.ImportFrom) and node.module == PARALLEL_STATE:
            functions |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == PARALLEL_STATE and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            dotted = isinstance(base, ast.Attribute) and ast.unparse(base) == PARALLEL_STATE
            if (isinstance(base, ast.Name) and base.id in aliases) or dotted:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id in functions:
            found.append((node.lineno, node.id))
    return found


def test_only_parallel_py_reads_megatron_process_group_globals():
    offenders = []
    for folder in GROUP_SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in GROUP_READERS:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            offenders += [f"{rel}:{line}: {text}" for line, text in _global_reads(tree)]
    assert not offenders, (
        "library code reads megatron's process-group globals; take a ProcessGroups (or the "
        "group) as an argument instead:\n" + "\n".join(offenders)
    )


def test_the_scan_sees_every_spelling():
    source = """
import megatron_ext.megatron_import  # noqa: F401
from megatron.core import parallel_state
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import get_tensor_model_parallel_group as tp_group
import megatron.core.parallel_state
import megatron.core.parallel_state as mps
parallel_state.get_data_parallel_group()
ps.is_pipeline_first_stage()
tp_group()
megatron.core.parallel_state.model_parallel_is_initialized()
mps.get_context_parallel_rank()
"""
    found = [text for _, text in _global_reads(ast.parse(source))]
    assert found == [
        "parallel_state.get_data_parallel_group",
        "ps.is_pipeline_first_stage",
        "tp_group",
        "megatron.core.parallel_state.model_parallel_is_initialized",
        "mps.get_context_parallel_rank",
    ]
    # ... and the allowed reader really reads them (the scan is not vacuous).
    parallel = (REPO / "megatron_ext" / "parallel.py").read_text(encoding="utf-8")
    assert len(_global_reads(ast.parse(parallel))) >= 8


def test_training_imports_nothing_from_lev():
    """The engines and the optimizer are generic: a module of the model declares what it needs
    of them through `training.engine.ModuleHooks` (LEVEmbedding does), never by its class; the
    --lev-* flags' LEVConfig is the config room's (`megatron_ext.config.lev`)."""
    graph = import_graph()
    into_lev = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("megatron_ext.training")
        for target in targets
        if target.startswith("megatron_ext.lev")
    )
    assert into_lev == []


def test_inference_imports_nothing_from_conversion():
    """conversion/ reads checkpoints through inference/ (`inference.loading`); the other way
    round would close a circle between the two subpackages."""
    graph = import_graph()
    edges = [
        (module, target)
        for module, targets in graph.items()
        if module.startswith("megatron_ext.inference")
        for target in targets
        if target.startswith("megatron_ext.conversion")
    ]
    assert edges == []
    assert any(
        t.startswith("megatron_ext.inference") for t in graph["megatron_ext.conversion.reshard"]
    )
