"""The house's layering, read from the source: `pallas_kernels` imports nothing from
`dflash_jax` (the library imports the kernels, never the reverse), and no two modules of
`dflash_jax` import each other, directly or through others (imports inside functions count:
they are circles deferred, not removed)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(package):
    out = {}
    base = os.path.join(ROOT, package)
    for d, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _imports(name, path, is_pkg):
    """Every module name an `import` / `from ... import` anywhere in the file refers to (a
    `from pkg import sub` counts as pkg.sub when that is a module)."""
    tree = ast.parse(open(path).read(), path)
    pkg = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _graph(package):
    mods = _modules(package)
    graph = {}
    for name, path in mods.items():
        refs = _imports(name, path, path.endswith("__init__.py"))
        graph[name] = {r for r in refs if r in mods and r != name}
    return mods, graph


def test_kernel_package_imports_nothing_from_the_library():
    mods = _modules("pallas_kernels")
    bad = {
        name: sorted(
            r
            for r in _imports(name, p, p.endswith("__init__.py"))
            if r.split(".")[0] == "dflash_jax"
        )
        for name, p in mods.items()
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"pallas_kernels imports the library: {bad}"


def _cycle(graph):
    """One import circle as a list of modules, or None (depth-first search, white/grey/black);
    a package importing its own submodules (`from . import x` in __init__) is not a circle
    unless the submodule imports the package back."""
    color, stack = {}, []

    def visit(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if color.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if not color.get(v):
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = 2
        return None

    for u in sorted(graph):
        if not color.get(u):
            found = visit(u)
            if found:
                return found
    return None


def test_no_import_circle_in_the_library_or_the_kernels():
    for package in ("dflash_jax", "pallas_kernels"):
        _, graph = _graph(package)
        # A package's __init__ re-exporting its submodules is the one allowed back edge: drop
        # edges from a submodule to its own parent package.
        for name in graph:
            graph[name] = {r for r in graph[name] if not name.startswith(r + ".")}
        assert _cycle(graph) is None, f"import circle in {package}: {' -> '.join(_cycle(graph))}"


def test_the_checker_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# The subpackages of dflash_jax, lowest first: a module may import its own subpackage and those
# before it, never one after it (the API package `dflash_jax` and the `python -m
# dflash_jax.launch` entry sit above them all and are imported by none).
LAYERS = (
    "support",
    "models",
    "data",
    "parallel",
    "drafters",
    "decoding",
    "training",
    "frontend",
    "dry_run",
)


def _upward_imports(graph, layers=LAYERS):
    """(importer, imported) pairs that go up the layer order or into a top-level module, and
    modules outside every layer."""

    def layer(m):
        parts = m.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in layers else None

    bad = []
    for name, refs in graph.items():
        if name.count(".") <= 1 and layer(name) is None:  # the API package, entry points
            continue
        if layer(name) is None:
            bad.append((name, "<in no layer>"))
            continue
        for r in refs:
            if layer(r) is None or layers.index(layer(r)) > layers.index(layer(name)):
                bad.append((name, r))
    return sorted(bad)


def test_the_subpackages_import_only_downward():
    mods, graph = _graph("dflash_jax")
    top = sorted(m for m in mods if m.count(".") == 1 and m.split(".")[1] not in LAYERS)
    assert top == ["dflash_jax.launch"], f"modules outside the subpackages: {top}"
    for name in graph:  # the root package's lazy table names no module statically
        graph[name] = {r for r in graph[name] if r != "dflash_jax"}
    assert not _upward_imports(graph), f"imports against the layer order: {_upward_imports(graph)}"


def test_the_layer_checker_sees_an_upward_import():
    graph = {
        "dflash_jax.models.config": {"dflash_jax.support.checks"},
        "dflash_jax.support.checks": {"dflash_jax.models.hub"},
        "dflash_jax.models.hub": set(),
        "dflash_jax.launch": {"dflash_jax.parallel.launch"},
        "dflash_jax.parallel.launch": set(),
    }
    assert _upward_imports(graph) == [("dflash_jax.support.checks", "dflash_jax.models.hub")]


# The drafter registry's direction (`dflash_jax.drafters.registry`): the rest of the library
# asks a drafter's kind and never imports a concrete drafter (or a module of one).
CONCRETE_DRAFTERS = (
    "dflash_jax.drafters.dflash",
    "dflash_jax.drafters.dflash2",
    "dflash_jax.drafters.eagle3",
    "dflash_jax.drafters.prompt_lookup",
)


def _concrete_importers(graph):
    return {
        name
        for name, refs in graph.items()
        if name != "dflash_jax"  # the API package re-exports the user objects
        and not name.startswith("dflash_jax.drafters")
        and any(r == c or r.startswith(c + ".") for r in refs for c in CONCRETE_DRAFTERS)
    }


def test_only_the_drafters_import_a_concrete_drafter():
    from dflash_jax.drafters import registry

    assert set(registry.KIND_MODULES) <= set(CONCRETE_DRAFTERS)
    _, graph = _graph("dflash_jax")
    importers = _concrete_importers(graph)
    assert not importers, f"import a concrete drafter, not its kind: {sorted(importers)}"


def test_the_drafter_import_check_sees_one():
    graph = {
        "dflash_jax.frontend.x": {"dflash_jax.drafters.eagle3"},
        "dflash_jax.frontend.y": {"dflash_jax.drafters.registry"},
        "dflash_jax.frontend.z": {"dflash_jax.drafters.dflash.model"},
        "dflash_jax.drafters.registry": {"dflash_jax.drafters.dflash"},
    }
    assert _concrete_importers(graph) == {"dflash_jax.frontend.x", "dflash_jax.frontend.z"}


# Where a drafter kind may be named in a comparison: its own package, the trainer's table of
# training kinds (`training/drafter_setup.py`), and the dry run, whose presets are DFlash
# drafters with DFlash 2 as their published variant. Everything else asks the kind.
KIND_NAMING_ALLOWED = (
    "dflash_jax.drafters",
    "dflash_jax.training.drafter_setup",
    "dflash_jax.dry_run",
)


def _kind_tests(source: str, kind_names) -> list:
    """(line, name) of each comparison (==, !=, in, not in) against a drafter kind's name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            for c in consts:
                if isinstance(c, ast.Constant) and c.value in kind_names:
                    out.append((node.lineno, c.value))
    return out


def test_no_module_outside_the_drafters_tests_for_a_drafter_kind():
    from dflash_jax.drafters import registry

    names = set(registry.names())
    found = {
        name: _kind_tests(open(path).read(), names)
        for name, path in _modules("dflash_jax").items()
        if not name.startswith(KIND_NAMING_ALLOWED)
    }
    found = {k: v for k, v in found.items() if v}
    assert not found, f"ask the drafter's kind instead: {found}"


def test_the_kind_test_check_sees_one():
    src = "if kind == 'eagle3' or x in ('a', 'dflash') or y != 'other':\n    pass\n"
    assert _kind_tests(src, {"eagle3", "dflash"}) == [(1, "eagle3"), (1, "dflash")]


# The longest function a module of the library or the kernels may hold (docstring included).
MAX_FUNCTION_LINES = 100


def _long_functions(source: str, limit: int = MAX_FUNCTION_LINES):
    tree = ast.parse(source)
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_function_of_the_library_or_kernels_is_over_100_lines():
    long = []
    for package in ("dflash_jax", "pallas_kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    found = _long_functions(f.read())
                long += [f"{os.path.relpath(path, ROOT)}:{fn} ({n} lines)" for fn, n in found]
    assert not long, f"split these into named steps: {long}"


def test_the_function_length_check_sees_a_long_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions("def g():\n    return 1\n") == []
