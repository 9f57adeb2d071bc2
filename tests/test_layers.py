"""The package's import graph is a layered DAG, checked by parsing the source with ``ast``.

Layers come from folders (``LAYERS``: no module list), lowest first; a module is in the layer of the deepest folder
(or file) of the table that holds it, and may import its own layer or lower ones:

    core            models/core/            the frozen target, decoding and verification, shared draft blocks,
                                            checkpoints
    export helpers  models/export/shared/   the export helpers a method's export.py builds on
    methods         models/methods/<name>/  one package per method; a method imports core, the export helpers
                                            and its own package only
    registry        models/registry.py
    data            data/
    export          models/export/          the rest of it: export, validation, the format table, serving
    train           train/
    decode          eval/decode/            the decoding loop (ladder, the B=1 and B-row APIs)
    bench           eval/bench/             the benchmark harness (python -m eval's work, cost model, report)
    engines         eval/engines/           vLLM and llama.cpp serving our exports (prompts from eval/bench/)
    eval            eval/__main__.py        python -m eval

train/ and the four eval layers form the top: train ranks with eval/decode/, and neither group imports the other.

A loose module in models/ outside these folders is in no layer, and reported.
Also: no import cycle (module-level and function-level imports both count, so a lazy import cannot hide one),
and no private name (``_x``) taken from another package module, by ``from m import _x`` or by ``m._x``. A
helper two modules need is public in one place (within one method package, its modules share freely).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "models", "data", "eval")

# folder (or file) → layer; a module is in the layer of its deepest entry. models/__init__.py is the container's
# empty marker, in the lowest layer.
LAYERS = {
    "models/__init__.py": "core",
    "models/core": "core",
    "models/export/shared": "export helpers",
    "models/methods": "methods",
    "models/registry.py": "registry",
    "data": "data",
    "models/export": "export",
    "train": "train",
    "eval/decode": "decode",
    "eval/bench": "bench",
    "eval/engines": "engines",
    "eval": "eval",
}
# rank of each layer, lowest first
RANK = {"core": 0, "export helpers": 1, "methods": 2, "registry": 3, "data": 4, "export": 5, "train": 6,
        "decode": 6, "bench": 7, "engines": 8, "eval": 9}
# the top: train/ and eval/ are two groups that must not import each other (eval's layers rank among themselves)
TOP = {"train": "train", "decode": "eval", "bench": "eval", "engines": "eval", "eval": "eval"}


def layer(mod: str) -> str | None:
    """The layer of the deepest ``LAYERS`` entry holding ``mod`` (a folder holds every module under it, a file
    only itself), or None."""
    parts = tuple(mod.split("."))
    best: tuple[int, str] | None = None
    for where, name in LAYERS.items():
        key = Path(where).parts
        if where.endswith(".py"):
            key = Path(where).with_suffix("").parts
            key, hit = (key[:-1], parts == key[:-1]) if key[-1] == "__init__" else (key, parts == key)
        else:
            hit = parts[: len(key)] == key
        if hit and (best is None or len(key) > best[0]):
            best = (len(key), name)
    return best[1] if best else None


def method_package(mod: str) -> str:
    """``models.methods.eagle3.net`` → ``models.methods.eagle3``."""
    return ".".join(mod.split(".")[:3])


def same_method_package(a: str, b: str) -> bool:
    return layer(a) == layer(b) == "methods" and method_package(a) == method_package(b)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name → file, for every module of the four packages (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against ``mod``)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(mods: dict[str, Path], root: Path = ROOT) -> tuple[dict[str, dict[str, int]], list[str]]:
    """(imports: module → {imported package module: line}, private-name violations)."""
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    private: list[str] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        where = lambda node: f"{path.relative_to(root)}:{node.lineno}"  # noqa: E731
        bound: dict[str, str] = {}  # local name → package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        edges[mod].setdefault(a.name, node.lineno)
                        bound[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in mods:  # `from models.methods import eagle3`: the submodule itself
                        edges[mod].setdefault(sub, node.lineno)
                        bound[a.asname or a.name] = sub
                    elif src in mods:
                        edges[mod].setdefault(src, node.lineno)
                        if (a.name.startswith("_") and not a.name.startswith("__")
                                and not same_method_package(mod, src)):
                            private.append(f"{where(node)}: {mod} imports private {src}.{a.name}")
        for node in ast.walk(tree):  # m._x on a name bound to a package module
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not same_method_package(mod, bound[node.value.id])):
                private.append(f"{where(node)}: {mod} uses private {bound[node.value.id]}.{node.attr}")
        edges[mod].pop(mod, None)
    return edges, private


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def arrow_violations(edges: dict[str, dict[str, int]], mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    bad = []
    for a, targets in sorted(edges.items()):
        la = layer(a)
        if la is None:
            bad.append(f"{mods[a].relative_to(root)}: module {a} is in no layer (no folder of LAYERS holds it)")
            continue
        for b, line in sorted(targets.items()):
            lb = layer(b)
            if lb is None:
                continue  # reported as its own module above
            at = f"{mods[a].relative_to(root)}:{line}: {a} ({la}) imports {b} ({lb})"
            if la in TOP and lb in TOP and TOP[la] != TOP[lb]:
                bad.append(f"{at}: {TOP[la]} and {TOP[lb]} must not import each other")
            elif RANK[lb] > RANK[la]:
                bad.append(f"{at}: upward arrow")
            elif la != lb and RANK[la] == RANK[lb]:
                bad.append(f"{at}: {la} and {lb} must not import each other")
            elif la == lb == "methods" and method_package(a) != method_package(b):
                bad.append(f"{at}: methods share code only through core")
    return bad


def package_init_violations(edges: dict[str, dict[str, int]], mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Importing a module runs its packages' __init__.py first, so what they import is imported by the module too:
    a package folder that holds a lower layer (models/export/ holds models/export/shared/) may not import above it
    in its __init__.py."""
    bad = []
    for a in sorted(mods):
        parts = a.split(".")
        for p in (".".join(parts[:i]) for i in range(1, len(parts))):
            for b, line in sorted(edges.get(p, {}).items()):
                if layer(a) and layer(b) and RANK[layer(b)] > RANK[layer(a)]:
                    bad.append(f"{mods[p].relative_to(root)}:{line}: {p} imports {b} ({layer(b)}), and it runs before"
                               f" {a} ({layer(a)}): upward arrow")
    return bad


def test_import_graph_is_a_layered_dag_without_private_crossings():
    mods = package_modules()
    edges, private = scan(mods)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    problems += arrow_violations(edges, mods) + package_init_violations(edges, mods) + private
    assert not problems, f"{len(problems)} layering violation(s):\n" + "\n".join(problems)


def test_the_checker_sees_each_kind_of_violation(tmp_path):
    """The checker itself: a planted cycle through a function-level import, an upward arrow (also between eval's
    layers), a method importing a method, train importing eval, a package __init__ importing above a lower layer
    it holds, and both spellings of a private import are each reported."""
    files = {
        "models/core/target.py": "def f():\n    from models import registry\n",
        "models/registry.py": "from models.core import target\n",
        "models/methods/eagle3/__init__.py": "from models.methods import medusa\n",
        "models/methods/medusa/__init__.py": ("from models.core.target import _fp\nfrom models.core import vocab\n"
                                              "vocab._x\n"),
        "models/methods/medusa/net.py": "from models.methods.medusa import _own\n",  # its own package: allowed
        "models/core/vocab.py": "",
        "train/loop.py": "import eval.decode.single\n",
        "eval/decode/single.py": "",
        "eval/bench/report.py": "from eval.engines import serving\n",
        "eval/engines/serving.py": "",
        "models/export/__init__.py": "from models import registry\n",
        "models/export/shared/common.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for pkg in ("models", "models/core", "models/methods", "models/export/shared", "train", "eval", "data"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    mods = package_modules(tmp_path)
    edges, private = scan(mods, tmp_path)
    found = "\n".join([str(c) for c in cycles(edges)] + arrow_violations(edges, mods, tmp_path)
                      + package_init_violations(edges, mods, tmp_path) + private)
    assert "['models.core.target', 'models.registry']" in found
    assert "models.core.target (core) imports models.registry (registry): upward arrow" in found
    assert ("models.methods.eagle3 (methods) imports models.methods.medusa (methods):"
            " methods share code only through core") in found
    assert ("train.loop (train) imports eval.decode.single (decode): train and eval must not import each other"
            in found)
    assert "eval.bench.report (bench) imports eval.engines.serving (engines): upward arrow" in found
    assert ("models.export imports models.registry (registry), and it runs before models.export.shared.common"
            " (export helpers): upward arrow") in found
    assert "imports private models.core.target._fp" in found
    assert "uses private models.core.vocab._x" in found
    assert "_own" not in found and "models.methods.medusa.net" not in found


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60  # files a reader can hold, functions that fit a screen


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function without its docstring (the why stays; the rule is about code)."""
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def test_files_and_functions_stay_small():
    """No module of the four packages over 500 lines and no function over 60 (docstring aside): a method that
    grows splits along its seams (network + loss, kernels, proposers) instead of becoming another 1,000 lines."""
    big = []
    for path in package_modules().values():
        src = path.read_text()
        if src.count("\n") > MAX_FILE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > MAX_FUNCTION_LINES:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} is {_function_lines(node)} lines")
    assert not big, "\n".join(big)


def test_layout_table_agrees_with_the_folders():
    """docs/layout.md's table names every method package and every core module, and its paths exist."""
    import re

    table = (ROOT / "docs" / "layout.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in table.splitlines() if line.startswith("| `")}
    for pkg in sorted((ROOT / "models" / "methods").iterdir()):
        if (pkg / "__init__.py").exists():
            assert f"`{pkg.name}`" in rows["`models/methods/<name>/`"], f"docs/layout.md lacks the method {pkg.name}"
    for mod in package_modules():
        if layer(mod) == "core" and mod.startswith("models.core."):
            name = mod.split(".")[2]
            assert f"`{name}`" in table or f"models/core/{name}.py" in table, f"docs/layout.md lacks core module {mod}"
    for key in rows:
        for path in re.findall(r"`([^`]+)`", key):
            if "<" not in path and "*" not in path:
                assert (ROOT / path).exists(), f"docs/layout.md names {path}, which does not exist"


def test_tests_import_conftest_by_its_package_path():
    """``from conftest import`` resolves to whichever conftest.py pytest put on sys.path first (tests/faults/ has
    one too), so under xdist it breaks by import order; tests name ``tests.conftest`` instead."""
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "tests").rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if line.startswith(("from conftest import", "import conftest"))]
    assert not bare, "import tests.conftest, not conftest: " + ", ".join(bare)
