"""The layout holds: no import cycle inside arpo_lib, and every package imports only what the
table of docs/architecture.md allows it (`MAY_IMPORT`, the table as data, with no exceptions).

Imports are read with `ast`, including those inside functions (a lazy import still ties two
modules together) and those under `if TYPE_CHECKING:` (an annotation that names a module above is
an arrow back up all the same: a reader must climb to understand it).
A module name given to `importlib` as a string is no import statement and is not seen: the
registries (`run/registry.py`) load the home modules of their entries that way, on purpose, so
that the ground floor can hold them (docs/architecture.md says so).
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "arpo_lib"

MAY_IMPORT: dict[str, set[str]] = {
    "__main__": {"cli"},
    "cli": {"experiments", "workflows", "build", "evaluation", "training", "viz", "rollout", "serving", "agent", "algo",
            "envs", "types", "actions", "run"},
    "experiments": {"workflows", "build", "evaluation", "training", "viz", "rollout", "serving", "agent", "algo", "envs",
                    "types", "actions", "run"},
    "workflows": {"build", "evaluation", "training", "viz", "rollout", "serving", "agent", "algo", "envs", "types",
                  "actions", "run"},
    "build": {"evaluation", "training", "viz", "rollout", "serving", "agent", "algo", "envs", "types", "actions",
              "run"},
    "evaluation": {"rollout", "agent", "algo", "envs", "types", "actions", "run"},
    "training": {"rollout", "agent", "algo", "envs", "types", "actions", "run"},
    "viz": {"evaluation", "rollout", "envs", "actions", "run"},
    "rollout": {"agent", "algo", "envs", "types", "actions", "run"},
    "serving": {"agent", "algo", "envs", "types", "actions", "run"},
    "agent": {"algo", "envs", "types", "actions", "run"},
    "algo": {"types", "run"},
    "envs": {"types", "actions", "run"},
    "types": {"run"},
    "actions": set(),
    "run": set(),
    "__init__": {"run"},
}
"""Each package or top-level module of arpo_lib -> the ones it may import: the table of
docs/architecture.md (`test_the_allow_map_is_the_documented_table` holds them together). `__init__`
is the package itself."""

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "vllm_ext" not in p.parts}


def imports_of(path: Path, modules: set[str], me: str) -> set[str]:
    """The arpo_lib modules `path` imports (explicitly, at any depth, annotation-only ones included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def resolve(base: str, names: list[str]) -> None:
        for name in names:
            candidate = f"{base}.{name}"
            found.add(candidate if candidate in modules else base)

    def visit(node: ast.AST) -> None:
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


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every arpo_lib module -> the arpo_lib modules it imports (read once per test session)."""
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


def component(module: str) -> str:
    """The row of `MAY_IMPORT` a module belongs to: its package or top-level module under arpo_lib."""
    return module.split(".")[1] if "." in module else "__init__"


def forbidden_imports(graph: dict[str, set[str]], may_import: dict[str, set[str]]) -> list[str]:
    """The imports of `graph` (module -> the modules it imports) that `may_import` does not allow,
    as "module -> target" lines. Free: a module's own package, and the packages that contain it
    (Python runs them before the module anyway: importing one adds no dependency)."""
    bad = []
    for module, targets in sorted(graph.items()):
        mine = component(module)
        if mine not in may_import:
            bad.append(f"{module} belongs to no row of the table (add its package to MAY_IMPORT and the docs)")
            continue
        for target in sorted(targets):
            theirs = component(target)
            if theirs == mine or module.startswith(target + "."):
                continue
            if theirs not in may_import[mine]:
                bad.append(f"{module} -> {target}")
    return bad


def documented_table(text: str) -> dict[str, set[str]]:
    """The layer table of docs/architecture.md as {row -> what it may import}: a row's first cell
    names its packages or modules (`envs/`, `cli.py`); its last cell the ones it may import, where
    "`x`, `y` and what they may import" means x, y and their own rows' entries."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        names = [n.removesuffix(".py").rstrip("/") for n in re.findall(r"`([^`]+)`", cells[0])]
        allowed = cells[-1]
        for name in names:
            rows[name] = (set(re.findall(r"`([^`]+)`", allowed)), "what they may import" in allowed
                          or "what it may import" in allowed)
    resolved: dict[str, set[str]] = {}

    def resolve(name: str, seen: tuple[str, ...] = ()) -> set[str]:
        assert name in rows, f"the table's 'may import' names `{name}`, which has no row"
        assert name not in seen, f"the table's rows refer to each other in a circle: {seen + (name,)}"
        if name not in resolved:
            direct, inherits = rows[name]
            resolved[name] = set(direct).union(*(resolve(d, seen + (name,)) for d in direct)) if inherits else direct
        return resolved[name]

    return {name: resolve(name) for name in rows}


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert imports_of(Path(__file__), {"arpo_lib"}, "tests.x") == set()


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the import graph looks empty: is the package where the test expects it?"
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles inside arpo_lib:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_packages_import_only_what_the_table_allows():
    graph = import_graph()
    assert {component(m) for m in graph} == set(MAY_IMPORT), "a row of MAY_IMPORT names nothing in arpo_lib, or back"
    bad = forbidden_imports(graph, MAY_IMPORT)
    assert not bad, "imports the table of docs/architecture.md does not allow:\n" + "\n".join(bad)


def test_the_allow_map_catches_what_a_ranking_let_through():
    """A single ranking allowed every import downwards; the table forbids some of those: the data
    between packages importing the action space, evaluation importing training, a viewer importing
    the model, the algorithm importing environments."""
    graph = {
        "arpo_lib.types": {"arpo_lib.actions", "arpo_lib.run.config"},
        "arpo_lib.evaluation.evaluate": {"arpo_lib.training.trainer", "arpo_lib.rollout.engine"},
        "arpo_lib.viz.draw": {"arpo_lib.agent.hf_policy", "arpo_lib.rollout.store"},
        "arpo_lib.viz.report": {"arpo_lib.evaluation.stats"},
        "arpo_lib.algo.loss": {"arpo_lib.envs.base", "arpo_lib.run.registry"},
        "arpo_lib.training.trainer": {"arpo_lib.viz.plots", "arpo_lib.serving.launch", "arpo_lib.training.backend"},
        "arpo_lib.build": {"arpo_lib.workflows", "arpo_lib.viz", "arpo_lib.training.trainer"},
        "arpo_lib.envs.workers.worker": {"arpo_lib", "arpo_lib.envs.base"},
        "arpo_lib.workflows.prepare": {"arpo_lib.build"},
        "arpo_lib.newpkg.thing": {"arpo_lib.run"},
    }
    assert forbidden_imports(graph, MAY_IMPORT) == [
        "arpo_lib.algo.loss -> arpo_lib.envs.base",
        "arpo_lib.build -> arpo_lib.workflows",
        "arpo_lib.evaluation.evaluate -> arpo_lib.training.trainer",
        "arpo_lib.newpkg.thing belongs to no row of the table (add its package to MAY_IMPORT and the docs)",
        "arpo_lib.training.trainer -> arpo_lib.serving.launch",
        "arpo_lib.training.trainer -> arpo_lib.viz.plots",
        "arpo_lib.types -> arpo_lib.actions",
        "arpo_lib.viz.draw -> arpo_lib.agent.hf_policy",
    ]


def test_the_allow_map_is_the_documented_table():
    documented = documented_table(ARCHITECTURE.read_text())
    differ = {name: (documented.get(name), MAY_IMPORT.get(name)) for name in documented.keys() | MAY_IMPORT.keys()
              if documented.get(name) != MAY_IMPORT.get(name)}
    assert not differ, f"docs/architecture.md's table (first) and MAY_IMPORT (second) differ: {differ}"
    # the notation is read as meant: a row that inherits, and one that does not
    rows = documented_table("## The layers\n| `a/` | x | `b` and what it may import |\n| `b.py` | y | `c` |\n"
                            "| `c/`, `d.py` | z | nothing |\n## next")
    assert rows == {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": set()}


def test_the_allowed_imports_have_no_cycle():
    """The table is layered: no package may import, through the table, one that may import it."""
    cycles = [c for c in strongly_connected(MAY_IMPORT) if len(c) > 1]
    assert not cycles, f"the table allows import cycles: {cycles}"


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


def test_the_retired_old_names_are_gone_and_nothing_uses_them():
    """`arpo_lib.plots` and `arpo_lib.trainer` (the shims of the names before the package layout)
    are retired: the notebooks, docs and tests use `arpo_lib.viz.plots` and
    `arpo_lib.build.trainer(cfg)`."""
    import importlib

    for name in ("arpo_lib.plots", "arpo_lib.trainer"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    old = re.compile(r"arpo_lib\.(plots|trainer)\b|from arpo_lib import (plots|trainer)\b")
    users = [p for p in [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
             if old.search(p.read_text())]
    assert not users, users


def test_the_trainer_reads_as_the_algorithm_and_reads_only_its_own_config_sections():
    """The trainer's size target: `training/trainer.py` under ~250 lines, `train_step` about 40, and the
    trainer and its update read `train.*` and `algo.*` only (the rest is read by the components
    `build.trainer` hands them)."""
    trainer = PACKAGE / "training" / "trainer.py"
    source = trainer.read_text()
    assert len(source.splitlines()) <= 250, len(source.splitlines())
    tree = ast.parse(source)
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    assert step.end_lineno - step.lineno + 1 <= 45
    for path in (trainer, PACKAGE / "training" / "update.py"):
        sections = set(re.findall(r"\bcfg\.(\w+)", path.read_text()))
        assert sections <= {"train", "algo", "to_dict"}, (path.name, sections)


MAX_MODULE_LINES = 650
"""A module longer than this holds several ideas: split it at its seams. The config schema is the
one exception (one dataclass per section, a docstring per field: docs/architecture.md)."""


def test_no_module_but_the_config_schema_is_longer_than_a_reader_holds():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert set(long) <= {"arpo_lib/run/config.py"}, long
