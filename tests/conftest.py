"""Shared fixtures: the tiny models (built by `./workbench setup`, or here on demand) and browsers."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

torch.set_num_threads(2)
for _var, _cmd in (("MINIWOB_CHROME_BINARY", "chromium"), ("MINIWOB_CHROMEDRIVER", "chromedriver")):
    if not os.environ.get(_var) and shutil.which(_cmd):
        os.environ[_var] = shutil.which(_cmd)


def _tiny_model(variant: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from arpo_lib.training.tiny_model import build_tiny_model, is_complete

    shipped = REPO / "models" / f"tiny-uitars-{variant}"
    if is_complete(shipped):
        return shipped
    return build_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{variant}", variant)


@pytest.fixture(scope="session")
def tiny_qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model("qwen2vl", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen25vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model("qwen25vl", tmp_path_factory)


@pytest.fixture(scope="session", params=["qwen2vl", "qwen25vl"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model(request.param, tmp_path_factory)


def _have_browser() -> bool:
    from arpo_lib.envs.miniwob.env import BrowserNotFoundError, ensure_chromium

    try:
        ensure_chromium()
        return True
    except BrowserNotFoundError:
        return False


needs_browser = pytest.mark.skipif(not _have_browser(), reason="chromium/chromedriver not installed")


@pytest.fixture(scope="session")
def chromium_available() -> bool:
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium/chromedriver not installed (./workbench setup installs them)")
    return True


@pytest.fixture(scope="session")
def warm_tiny_qwen2vl(tiny_qwen2vl, chromium_available, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL model after a short supervised warm start on scripted demonstrations of
    click-test and click-button: it answers with real UI-TARS actions (the untrained one answers
    with newlines), which equivalence tests between backends need."""
    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.training.sft import collect_demonstrations, supervised_warm_start

    out = tmp_path_factory.mktemp("warm") / "tiny-uitars-qwen2vl-warm"
    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=48)
    with EnvPool(2, {"scale": 2, "max_steps": 3}) as pool:
        demos = collect_demonstrations(policy, pool, ["miniwob/click-test", "miniwob/click-button"], 4, seed=0,
                                       max_steps=3, progress=False)
    torch.manual_seed(0)
    supervised_warm_start(policy, demos, steps=150, lr=3e-3, batch_size=4, seed=0, progress=False)
    policy.save(out)
    return out


# ---- reliability tests (tests/reliability): short variants in CI, ARPO_LONG_TESTS=1 for the long
# ones; each records its figures (faults injected, trials, inputs, soak slope) with `figures` into
# runs/reliability/<test>.json, which `./workbench reliability` renders into docs/reliability.md.
LONG = os.environ.get("ARPO_LONG_TESTS", "") not in ("", "0")
FIGURES_DIR = Path(os.environ.get("ARPO_FIGURES_DIR", REPO / "runs" / "reliability"))


def served_model_overrides(config: Path) -> list[str]:
    """What a shipped config needs beside a switch to served rollouts: one whose evaluation is the
    scripted agent (which acts in process) evaluates the model instead."""
    scripted = (yaml.safe_load(config.read_text()) or {}).get("eval", {}).get("policy") == "scripted"
    return ["eval.policy=model"] if scripted else []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long` (end-to-end runs of minutes whose paths shorter tests also cover) run
    under ARPO_LONG_TESTS=1 only, which keeps the CI suite near 45 minutes on 2 cores."""
    if LONG:
        return
    skip = pytest.mark.skip(reason="a long test: ARPO_LONG_TESTS=1 runs it")
    for item in items:
        if item.get_closest_marker("long") is not None or _a_long_variant(item):
            item.add_marker(skip)


def _a_long_variant(item: pytest.Item) -> bool:
    """`@pytest.mark.long_variants("gnome")`: the test's variants with that parameter id are long
    (the same attack on GNOME where the openbox variant covers its mechanism in CI)."""
    marker = item.get_closest_marker("long_variants")
    callspec = getattr(item, "callspec", None)
    return marker is not None and callspec is not None and bool(set(callspec.id.split("-")) & set(marker.args))


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


@pytest.fixture(scope="module")
def policy(tiny_model):
    """An in-process policy on each tiny model (module-scoped: one load per test module)."""
    from arpo_lib.agent.hf_policy import HFPolicy

    torch.manual_seed(0)
    return HFPolicy(tiny_model, device="cpu", max_new_tokens=24, history_images=15)


# ---- nothing outlives the suite: every process the tests start (browsers, drivers, environment
# workers, servers, Ray) carries SESSION_MARKER in its environment; at the end of the session any
# such process still running is reported, killed, and fails the run.
SESSION_MARKER = "ARPO_TEST_SESSION"
LEAK_GRACE_S = float(os.environ.get("ARPO_LEAK_GRACE_S", "20"))


def pytest_configure(config: pytest.Config) -> None:
    import uuid

    os.environ.setdefault(SESSION_MARKER, uuid.uuid4().hex)


def session_processes(marker: str) -> dict[int, tuple[str, str]]:
    """pid -> (command line, the test that started it) of live processes carrying the marker."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            if f"{SESSION_MARKER}={marker}".encode() not in env:
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie is dead, waiting to be reaped
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if "multiprocessing.resource_tracker" in cmd:
                continue  # multiprocessing's own helper: it ends with this process
            test = next((e.decode(errors="replace").split("=", 1)[1] for e in env
                         if e.startswith(b"PYTEST_CURRENT_TEST=")), "?")
            found[int(entry.name)] = (cmd[:160], test)
        except (OSError, IndexError):
            continue
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import signal

    marker = os.environ.get(SESSION_MARKER)
    if not marker or not Path("/proc").is_dir() or hasattr(session.config, "workerinput"):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = session_processes(marker)
    while leaked and time.monotonic() < deadline:
        time.sleep(1.0)
        leaked = session_processes(marker)
    if not leaked:
        return
    lines = [f"  pid {pid}: {cmd}  (started during {test})" for pid, (cmd, test) in sorted(leaked.items())]
    message = f"\n{len(leaked)} process(es) started by the tests outlived them (killed now):\n" + "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def osworld_python() -> str:
    """$ARPO_OSWORLD_PYTHON where set; else the tests' own OSWorld environment, built by
    `setup_osworld.sh --light --desktop-env=pypi` (desktop-env 1.0.2 from PyPI: GitHub, where the
    fork is, cannot be reached from CI; and what its evaluator imports, ~1.5 GB, about a minute the
    first time on a machine; torch borrowed from this environment)."""
    from desktop_sandbox.sandbox import desktop_unavailable
    from arpo_lib.envs.osworld.env import workbench_cache

    if desktop_unavailable():
        pytest.skip(desktop_unavailable() or "")
    if os.environ.get("ARPO_OSWORLD_PYTHON"):
        return os.environ["ARPO_OSWORLD_PYTHON"]
    import subprocess
    import sysconfig

    env = {**os.environ, "ARPO_OSWORLD_VENV": str(workbench_cache() / "test-venv-osworld"),
           "ARPO_OSWORLD_TORCH_FROM": sysconfig.get_paths()["purelib"]}
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup_osworld.sh"), "--light", "--desktop-env=pypi"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
