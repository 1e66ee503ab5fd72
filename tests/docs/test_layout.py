"""The package layout docs/architecture.md §9 states holds in the code (pure file reading, no import).

* imports run one way: policies → core → vllm → serve, with kernels, models, sim and bench as side rooms
  (``MAY_IMPORT``); ``vllm/offline/`` (in-process tools) is never imported by the engine hooks;
* no two modules import each other, at module level or inside a function;
* no package folder holds more than 12 modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

PACKAGE = ROOT / "vtoken"
LEAVES = {"vtoken", "errors", "metric_names"}  # imported by anyone, import no room
MAY_IMPORT = {  # room → the rooms it may import (besides itself and the leaves)
    "policies": set(),
    "core": {"policies"},
    "kernels": {"policies", "core"},
    "models": set(),
    "vllm": {"policies", "core", "kernels"},
    "vllm.offline": {"policies", "core", "kernels", "vllm", "models"},
    "serve": {"policies", "core", "vllm", "models"},
    "sim": {"policies", "core", "models"},
    "bench": {"policies", "core", "kernels", "vllm", "vllm.offline", "serve", "sim", "models"},
    "cli": {"policies", "core", "vllm", "vllm.offline", "serve", "sim", "bench", "models"},
}
MAX_MODULES = 12


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def room(module: str) -> str:
    """The room of a ``vtoken`` module: its first package below ``vtoken`` (``vllm.offline`` its own)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "vtoken"
    if parts[1:3] == ["vllm", "offline"]:
        return "vllm.offline"
    return parts[1]


def imports(source: str, module: str, known: set[str]) -> set[str]:
    """The ``vtoken`` modules ``source`` imports anywhere (module level or inside functions), ``from PKG
    import MODULE`` counted as MODULE (pure)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vtoken":
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "vtoken"}
    return (out & known) - {module}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p): p for p in package.rglob("*.py")}
    return {m: imports(p.read_text(), m, set(files)) for m, p in files.items()}


def against_the_rule(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        src = room(module)
        for target in sorted(targets):
            dst = room(target)
            if dst != src and dst not in LEAVES and dst not in MAY_IMPORT.get(src, set()):
                bad.append(f"{module} ({src}) imports {target} ({dst})")
    return bad


def mutual(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, set()))


def test_imports_run_one_way():
    assert against_the_rule(import_graph()) == []


def test_no_two_modules_import_each_other():
    assert mutual(import_graph()) == []


def test_no_package_folder_holds_more_than_12_modules():
    folders = {p.parent for p in PACKAGE.rglob("__init__.py")}
    crowded = {str(f.relative_to(ROOT)): n for f in folders if (n := len(list(f.glob("*.py")))) > MAX_MODULES}
    assert crowded == {}


def test_the_checks_catch_a_cycle_and_a_wrong_way_import(tmp_path, monkeypatch):
    monkeypatch.setattr("test_layout.ROOT", tmp_path)
    pkg = tmp_path / "vtoken"
    for name, text in {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from vtoken.core import b\n",
        "core/b.py": "from vtoken.core.a import f\n",
        "core/c.py": "from vtoken.serve.x import y\n",
        "serve/__init__.py": "",
        "serve/x.py": "from vtoken.core.c import z\ny = 1\n",
        "vllm/__init__.py": "",
        "vllm/scheduler.py": "from vtoken.vllm.offline import launch\n",
        "vllm/offline/__init__.py": "",
        "vllm/offline/launch.py": "",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert mutual(graph) == [("vtoken.core.a", "vtoken.core.b"), ("vtoken.core.c", "vtoken.serve.x")]
    assert against_the_rule(graph) == [
        "vtoken.core.c (core) imports vtoken.serve.x (serve)",
        "vtoken.vllm.scheduler (vllm) imports vtoken.vllm.offline (vllm.offline)",
        "vtoken.vllm.scheduler (vllm) imports vtoken.vllm.offline.launch (vllm.offline)",
    ]
