"""The package's one import rule, read from the source: the core never imports a tool (train.py, the entry point,
wires them in), no tool imports train.py, and no module imports itself back through others. Also the core's
line budget, which is what keeps it readable in an afternoon."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_trainer"
ENTRY = "fsdp_trainer.train"
CORE_LINE_BUDGET = 3000


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere in it (inside functions too), as dotted names."""
    name = module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports a module; `from mod import name` imports mod.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    return {name: imports_of(path, package, set(modules)) - {name} for name, path in modules.items()}


def is_tool(name: str) -> bool:
    return name.startswith("fsdp_trainer.tools")


def rule_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = [f"{m} (core) imports {t}" for m, deps in graph.items() if not is_tool(m) and m != ENTRY
           for t in deps if is_tool(t)]
    bad += [f"{m} (tool) imports {ENTRY}" for m, deps in graph.items() if is_tool(m) and ENTRY in deps]
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that is on one (depth-first search; a package __init__ counts as its own
    module, not as every submodule)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_core_imports_no_tool_and_no_tool_imports_the_entry_point():
    assert rule_violations(import_graph(PACKAGE)) == []


def test_no_module_imports_itself_back():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_checks_catch_a_planted_violation_and_cycle(tmp_path):
    package = tmp_path / "fsdp_trainer"
    (package / "tools").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tools" / "__init__.py").write_text("")
    (package / "data.py").write_text("def f():\n    from fsdp_trainer.tools import plan\n")
    (package / "tools" / "plan.py").write_text("from fsdp_trainer import config\n")
    (package / "config.py").write_text("from fsdp_trainer.models.llama import Transformer\n")
    (package / "models").mkdir()
    (package / "models" / "llama.py").write_text("from .. import config\n")
    (package / "train.py").write_text("from fsdp_trainer.tools import plan\n")
    graph = import_graph(package)
    assert rule_violations(graph) == ["fsdp_trainer.data (core) imports fsdp_trainer.tools.plan"]
    assert cycles(graph) == [["fsdp_trainer.config", "fsdp_trainer.models.llama", "fsdp_trainer.config"]]


def test_the_core_fits_its_line_budget():
    lines = {p.relative_to(PACKAGE): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
             if "tools" not in p.relative_to(PACKAGE).parts}
    if sum(lines.values()) > CORE_LINE_BUDGET:
        pytest.fail(f"the core is {sum(lines.values())} lines, over its budget of {CORE_LINE_BUDGET}: "
                    + ", ".join(f"{p} {n}" for p, n in sorted(lines.items(), key=lambda kv: -kv[1])))
