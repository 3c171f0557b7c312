"""Reliability tests: short variants run in CI; `ARPO_LONG_TESTS=1` runs the long ones.

Each test records its figures (faults injected, trials, inputs, soak slope) with the `figures`
fixture into `runs/reliability/<test>.json`; `./workbench reliability` runs the long variants and
renders those figures into docs/reliability.md.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
LONG = os.environ.get("ARPO_LONG_TESTS", "") not in ("", "0")
FIGURES_DIR = Path(os.environ.get("ARPO_FIGURES_DIR", REPO / "runs" / "reliability"))


def _scale(short: Any, long: Any) -> Any:
    return long if LONG else short


@pytest.fixture
def scale():
    """`scale(short, long)`: the CI-sized value, or the long one under ARPO_LONG_TESTS=1."""
    return _scale


@pytest.fixture
def figures(request: pytest.FixtureRequest):
    """A dict the test fills with its measured figures; written when the test passes."""
    record: dict[str, Any] = {"test": request.node.nodeid, "variant": "long" if LONG else "short"}
    start = time.monotonic()
    yield record
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.passed:
        return  # figures of a failed test are not evidence of anything
    record["seconds"] = round(time.monotonic() - start, 1)
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    (FIGURES_DIR / f"{request.node.name}.json").write_text(json.dumps(record, indent=1, default=str))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report
