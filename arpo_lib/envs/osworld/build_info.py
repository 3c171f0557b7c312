"""Which desktop_env scored a result: the ARPO authors' fork or PyPI's desktop-env.

Their checkers differ (16 evaluator files between PyPI's 1.0.2 and the fork's era, some by hundreds
of lines) and only the fork has `pause()`/`unpause()`, so numbers made with one are not the other's.
`scripts/setup_osworld.sh --desktop-env=fork|pypi` writes what it installed into the environment
(`<venv>/arpo-desktop-env.json`); `desktop_env_build(python)` reads that and the installed package
itself (version, a hash of its evaluator sources, whether it can pause) in the interpreter that
runs the environment workers. Evaluations put it in results.json (`desktop_env`), runs in
`<run>/desktop_env.json`, and comparisons warn when two sides differ.

Standard library only: imported where the environment workers run.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

MARKER = "arpo-desktop-env.json"
"""What setup_osworld.sh installed, in the environment's prefix: {"source": "fork"|"pypi", ...}."""

FORK_REPO = "FanbinLu/OSWorld"
FORK_COMMIT = "7a6409d7f54e335181398b10038ddf3beda9ab33"
"""ARPO's OSWorld submodule (the same commit its task files come from)."""

KNOWN_EVALUATORS = {
    "7f939d663086cc2a": "PyPI desktop-env 1.0.2",
    "b8033a29b2441506": "the ARPO-era fork's copy vendored in genalyu/3SPO_GUI (OSWorld/ at 280761d)",
}
"""`evaluators_sha256` of builds seen here, for a desktop_env installed without the setup script."""

_PROBE = r"""
import hashlib, importlib.metadata, importlib.util, json, pathlib, sys
spec = importlib.util.find_spec("desktop_env")
if spec is None or spec.origin is None:
    print(json.dumps({"installed": False}))
    raise SystemExit
root = pathlib.Path(spec.origin).parent
version = None
for name in ("desktop-env", "desktop_env"):
    try:
        version = importlib.metadata.version(name)
        break
    except importlib.metadata.PackageNotFoundError:
        pass
digest = hashlib.sha256()
for path in sorted((root / "evaluators").rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode())
    digest.update(path.read_bytes())
main = root / "desktop_env.py"
marker = pathlib.Path(sys.prefix) / "%s"
info = {"installed": True, "version": version, "path": str(root), "evaluators_sha256": digest.hexdigest()[:16],
        "has_pause": main.is_file() and "def pause(" in main.read_text(errors="replace")}
if marker.is_file():
    info["setup"] = json.loads(marker.read_text())
print(json.dumps(info))
""" % MARKER


@functools.lru_cache(maxsize=8)
def _probe(python: str, pythonpath: str | None) -> str:
    import os

    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([python, "-I" if pythonpath is None else "-s", "-c", _PROBE], capture_output=True,
                          text=True, timeout=120, env=env)
    if done.returncode != 0:
        return json.dumps({"installed": False, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]})
    return done.stdout.strip().splitlines()[-1]


def desktop_env_build(python: str | None = None, *, provider: str | None = None) -> dict[str, Any]:
    """What desktop_env the interpreter `python` (default: this one) imports, with a `label` for
    reports: "fork FanbinLu/OSWorld@7a6409d", "pypi desktop-env 1.0.2", or what is known of a build
    installed by hand. `provider` "fake" needs none (the fake VM is the workbench's own)."""
    if provider == "fake":
        return {"installed": False, "label": "fake (FakeDesktopEnv, no checkers)", "source": "fake"}
    import os

    info = json.loads(_probe(python or sys.executable, os.environ.get("PYTHONPATH")))
    info["label"] = build_label(info)
    info["source"] = (info.get("setup") or {}).get("source", "unknown")
    return info


def build_label(info: dict[str, Any]) -> str:
    if not info.get("installed"):
        return "no desktop_env" + (f" ({info['error']})" if info.get("error") else "")
    setup = info.get("setup") or {}
    if setup.get("source") == "fork":
        if setup.get("from"):  # a local copy: what it holds is known by its evaluators, not by a commit
            known = KNOWN_EVALUATORS.get(info.get("evaluators_sha256", ""))
            return (f"fork (local copy {setup['from']}, evaluators {info.get('evaluators_sha256')}"
                    + (f": {known})" if known else ")"))
        return f"fork {setup.get('repository', FORK_REPO)}@{str(setup.get('commit', '?'))[:7]}"
    if setup.get("source") == "pypi":
        return f"pypi desktop-env {info.get('version')}"
    known = KNOWN_EVALUATORS.get(info.get("evaluators_sha256", ""))
    return (f"desktop_env {info.get('version')} installed by hand"
            + (f" (evaluators as {known})" if known else f" (evaluators {info.get('evaluators_sha256')})"))


def same_build(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two recorded builds score alike: the same evaluator sources and pause support
    (None, a result from before builds were recorded, is unknown and compares as different)."""
    if not a or not b:
        return False
    keys = ("installed", "evaluators_sha256", "has_pause")
    return all(a.get(k) == b.get(k) for k in keys)


def desktop_env_of(cfg: Any) -> dict[str, Any] | None:
    """`desktop_env_build` for a run config (`RunConfig`): the interpreter env.python names (`auto`:
    OSWorld's own environment), the provider of env.options; None without osworld tasks."""
    tasks = list(cfg.env.tasks) + list(cfg.eval.tasks or []) + list(cfg.select.tasks or [])
    if not any(t.startswith("osworld/") for t in tasks):
        return None
    python = cfg.env.python
    if python == "auto":
        from arpo_lib.envs.osworld.env import find_osworld_python

        python = find_osworld_python()
    return desktop_env_build(python, provider=cfg.env.options.get("provider"))
