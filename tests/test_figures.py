"""Figures the README and the guides show are the ones their results files hold (a figure that
moves with the code moves in the prose too)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def test_the_readmes_one_gpu_table_is_the_planners_committed_table():
    committed = _table_rows((RESULTS / "one_gpu_table.md").read_text())
    assert len(committed) == 5
    readme = (ROOT / "README.md").read_text()
    for row in committed[1:]:
        assert row in readme, f"README's one-GPU table differs from benchmarks/results/one_gpu_table.md: {row}"


def test_the_gpu_quick_starts_table_is_the_committed_estimate():
    spec = importlib.util.spec_from_file_location("gpu_recipes", ROOT / "scripts" / "gpu_recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_recipes"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    rows = json.loads((RESULTS / "gpu_recipes.json").read_text())["recipes"]
    assert [r["recipe"] for r in rows] == [r.key for r in module.RECIPES]
    doc = (ROOT / "docs" / "gpu-quickstart.md").read_text()
    for line in module.table(rows):
        assert line in doc, f"docs/gpu-quickstart.md's table differs from benchmarks/results/gpu_recipes.json: {line}"


def test_the_suite_figures_in_getting_started_are_those_of_ci_durations():
    header = (RESULTS / "ci_durations.txt").read_text().splitlines()[0]
    passed, skipped = map(int, re.search(r"(\d+) passed, (\d+) skipped", header).groups())
    minutes = re.search(r"([\d.]+) min with set-up", header).group(1)
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    assert f"{passed:,} pass, {skipped} skipped" in guide and f"{minutes} min from a clean clone" in guide


def test_the_smoke_seeds_table_in_getting_started_is_the_committed_run():
    record = json.loads((RESULTS / "smoke_seeds.json").read_text())
    assert record["every_seed_gained"] and len(record["summaries"]) == 5
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    for row in _table_rows(record["table"])[1:]:
        seed, before, after, gain, steps = (c.strip() for c in row.strip("|").split("|")[:5])
        assert f"| {seed} | {before} -> {after} | {gain} | {steps} |" in guide, row


def test_the_osworld_arpo_run_in_osworld_md_is_the_committed_run():
    """docs/osworld.md's six-step ARPO run on OSWorld's tasks: its figures are osworld_arpo.json's,
    and the executed notebook beside it ran without an error."""
    run = json.loads((RESULTS / "osworld_arpo.json").read_text())
    doc = " ".join((ROOT / "docs" / "osworld.md").read_text().split())
    steps, totals = run["steps"], run["totals"]
    said = (f"{len(steps)} ARPO steps" if len(steps) != 6 else "Six ARPO steps", f"{totals['replay_injections']} replay injections",
            f"{totals['wall_s']:.0f} s on 2 cores", f"success {steps[0]['success_rate']:.2f} at the first step")
    for text in said:
        assert text in doc, f"docs/osworld.md does not say {text!r} (benchmarks/results/osworld_arpo.json)"
    assert totals["env_errors"] == totals["checker_errors"] == 0 and "no environment or checker failure" in doc
    assert all(s["success_rate"] == 0 for s in steps[1:]) and "and 0 after" in doc
    assert run["notebook_errors"] == []
    cells = json.loads((RESULTS / "osworld_arpo_subset_training.ipynb").read_text())["cells"]
    assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]


def test_the_prestart_and_density_tables_in_cluster_md_are_the_committed_runs():
    doc = (ROOT / "docs" / "cluster.md").read_text()
    for row in json.loads((RESULTS / "osworld_sandbox_prestart.json").read_text())["rows"]:
        desktop_s = f"{row['reset_desktop_s']:.2f}" if row["prestart"] else f"{row['reset_desktop_s']:.1f}"
        line = f"| {row['envs']} | {'on' if row['prestart'] else 'off'} | {row['reset_s']:.1f} | {desktop_s} |"
        assert line in doc, f"docs/cluster.md's prestart table differs from the results file: {line}"
    density = {(r["desktop"], r["envs"]): r for r in
               json.loads((RESULTS / "osworld_sandbox_density.json").read_text())["rows"]}
    for desktop, envs in (("gnome", 1), ("gnome", 4), ("gnome", 8), ("openbox", 1), ("openbox", 8)):
        row = density[(desktop, envs)]
        name = "GNOME" if desktop == "gnome" else "openbox"
        line = f"| {name} | {envs} | {row['step_s']:.2f} | {row['pss_mib']:.0f} | {row['reset_s']:.1f} |"
        assert line in doc, f"docs/cluster.md's density table differs from the results file: {line}"
