"""The layout holds: no import cycle inside arpo_lib, and every package imports only the layers below.

Imports are read with `ast`, including those inside functions (a lazy import still ties two
modules together); imports under `if TYPE_CHECKING:` are annotations only and do not count.
See docs/architecture.md for the layers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "arpo_lib"

LAYERS = [
    ("run",),
    ("actions",),
    ("types",),
    ("envs",),
    ("algo",),
    ("agent",),
    ("serving",),
    ("rollout",),
    ("viz",),
    ("training",),
    ("evaluation",),
    ("build",),
    ("cli", "workflows", "experiments", "__main__", "plots", "trainer"),
]
"""Bottom to top. `plots` and `trainer` at the top are the old names kept for users' notebooks."""


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "vllm_ext" not in p.parts}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str], me: str) -> set[str]:
    """The arpo_lib modules `path` imports (explicitly, at any depth, outside TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def resolve(base: str, names: list[str]) -> None:
        for name in names:
            candidate = f"{base}.{name}"
            found.add(candidate if candidate in modules else base)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("arpo_lib"):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me if is_package else me.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if base.startswith("arpo_lib"):
                resolve(base, [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(me)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    names = set(modules)
    return {name: imports_of(path, names, name) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components (iterative, no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                components.append(sorted(component))
    return components


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS and docs/architecture.md")


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert imports_of(Path(__file__), {"arpo_lib"}, "tests.x") == set()


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the import graph looks empty: is the package where the test expects it?"
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles inside arpo_lib:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_packages_import_only_lower_layers():
    bad = []
    for module, targets in import_graph().items():
        if module == "arpo_lib":
            continue
        for target in targets:
            if target == "arpo_lib" or target.split(".")[1] == module.split(".")[1]:
                continue  # the package itself, or a sibling inside the same package
            if layer_of(target) > layer_of(module):  # same rank: the top layer's modules
                bad.append(f"{module} -> {target}")
    assert not bad, "imports that go up between layers:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("module", ["arpo_lib.run.config", "arpo_lib.run.layout", "arpo_lib.run.records",
                                   "arpo_lib.run.seeding", "arpo_lib.run.tracking", "arpo_lib.run.logs"])
def test_the_ground_floor_imports_nothing_of_ours(module):
    others = {t for t in import_graph()[module] if not t.startswith("arpo_lib.run")}
    assert not others, f"{module} imports {others}"


def test_types_imports_only_the_ground_floor():
    """The data between the packages is read by environment workers in OSWorld's own interpreter:
    it may lean on run/ only (never actions, agent or torch)."""
    others = {t for t in import_graph()["arpo_lib.types"] if not t.startswith("arpo_lib.run")}
    assert not others, f"arpo_lib.types imports {others}"


def test_public_names_keep_working():
    from arpo_lib.actions import ActionParseError, parse_response, smart_resize, to_pyautogui
    from arpo_lib.algo import ReplayBuffer, group_advantages, policy_loss
    from arpo_lib.envs import make_env

    assert all(callable(x) for x in (parse_response, smart_resize, to_pyautogui, group_advantages, policy_loss,
                                     make_env))
    assert issubclass(ActionParseError, ValueError) and ReplayBuffer().enabled


def test_the_old_names_users_notebooks_hold_still_work(tmp_path, tiny_qwen2vl):
    import importlib
    import sys

    from arpo_lib.run.config import load_config

    sys.modules.pop("arpo_lib.plots", None)
    with pytest.warns(DeprecationWarning, match="arpo_lib.viz.plots"):
        plots = importlib.import_module("arpo_lib.plots")
    assert plots.plot_training is importlib.import_module("arpo_lib.viz.plots").plot_training
    from arpo_lib.trainer import Trainer

    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=old"])
    with pytest.warns(DeprecationWarning, match="build.trainer"):
        trainer = Trainer(cfg)
    trainer.close()
    assert trainer.step == 0 and (tmp_path / "old" / "config.yaml").is_file()
