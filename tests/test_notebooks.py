"""Notebooks are thin lab protocols that papermill can parameterise and execute."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_a_thin_parameterised_protocol(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, "exactly one papermill parameters cell"
    src = "".join(params[0]["source"])
    assert re.search(r"^config = ", src, re.M) and re.search(r"^overrides = ", src, re.M)
    for cell in code:
        body = "".join(cell["source"])
        assert not re.search(r"^\s*(def|class) ", body, re.M), "notebooks call arpo_lib, they define nothing"
        assert not cell.get("outputs"), "commit notebooks without outputs"


@pytest.mark.slow
def test_smoke_notebook_executes_headlessly(tmp_path, tiny_qwen2vl, chromium_available):
    from arpo_lib.workflows import execute_notebook

    overrides = [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "train.steps=1", "warm_start.steps=20",
                 "warm_start.demos_per_task=2", "eval.samples_per_task=1", "logging.progress=false",
                 "env.tasks=[miniwob/click-test, miniwob/click-button]"]
    out = execute_notebook("notebooks/smoke_test.ipynb", {"overrides": overrides}, run_name="nb",
                           out_dir=tmp_path)
    nb = json.loads(out.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "Smoke run summary" in text and "evaluation 'before'" in text and "evaluation 'after'" in text
    summary = json.loads((tmp_path / "nb" / "summary.json").read_text())
    assert summary["train_steps"] == 1 and summary["warm_start_steps"] == 20
    assert summary["peak_memory_gb"] > 0 and summary["seconds_total"] > 0
    assert (tmp_path / "nb" / "eval" / "before" / "results.json").is_file()
    assert (tmp_path / "nb" / "checkpoints" / "step_000001" / ".complete").is_file()
