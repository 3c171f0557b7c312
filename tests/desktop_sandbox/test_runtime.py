"""The sandbox's staged Python (desktop_sandbox/runtime.py): only what the in-sandbox side imports,
nothing else of the host's environments, built once and reused. No sandbox needed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from desktop_sandbox import confinement, runtime


def _dist(site: Path, name: str, version: str, modules: dict[str, str], requires: list[str] = ()) -> None:
    """A distribution installed in `site` as pip leaves one: its files, METADATA and RECORD."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    for rel, text in modules.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


def test_what_is_staged_is_the_roots_and_what_they_require_on_this_platform(tmp_path):
    site = tmp_path / "site-packages"
    _dist(site, "agentlib", "1.0", {"agentlib/__init__.py": ""},
          ["helper>=2", "winonly; sys_platform == 'win32'", "docs-tool; extra == 'docs'"])
    _dist(site, "helper", "2.1", {"helper.py": "X = 1\n"})
    _dist(site, "winonly", "1.0", {"winonly.py": ""})
    _dist(site, "docs_tool", "1.0", {"docs_tool.py": ""})
    _dist(site, "desktop_env", "1.0.2", {"desktop_env/evaluators/metrics/table.py": "SECRET = 1\n"})
    names = [d.metadata["Name"] for d in runtime.distributions([str(site)], roots=("agentlib", "not-installed"))]
    assert names == ["agentlib", "helper"]


def test_the_real_stage_holds_pyautogui_and_its_needs_and_nothing_else():
    staged = runtime.stage(tuple(confinement.site_directories()))
    site = dict(staged.binds)
    host_site = next(h for h, inside in staged.binds if inside == runtime.SITE_IN_SANDBOX)
    entries = {p.name for p in Path(host_site).iterdir()}
    assert {"pyautogui", "pymsgbox", "pyscreeze", "mouseinfo", "Xlib", "PIL"} <= entries, entries
    assert not entries & {"torch", "transformers", "arpo_lib", "desktop_env", "numpy", "ray"}, entries
    assert runtime.SITE_IN_SANDBOX in staged.site and site[host_site] == runtime.SITE_IN_SANDBOX
    for host, _ in staged.binds:  # nowhere near the checkout or the environments
        assert Path(host).parent.name == f"arpo-sandbox-runtime-{os.geteuid()}"
        assert not host.startswith((sys.prefix + "/", str(Path(__file__).resolve().parents[2]) + "/"))


def test_a_stage_is_built_once_and_reused(monkeypatch):
    staged = runtime.stage(tuple(confinement.site_directories()))
    runtime.stage.cache_clear()
    monkeypatch.setattr(runtime, "_place", lambda *a: pytest.fail("a complete stage was built again"))
    assert runtime.stage(tuple(confinement.site_directories())) == staged
    runtime.stage.cache_clear()


@pytest.mark.skipif(sys.base_prefix.startswith("/usr/"), reason="a system interpreter is used in place, not staged")
def test_the_staged_interpreter_runs_from_its_stage_alone():
    staged = runtime.stage(tuple(confinement.site_directories()))
    host = next(h for h, inside in staged.binds if inside == runtime.PYTHON_IN_SANDBOX)
    version = Path(staged.python).name
    env = {"PATH": "/usr/bin:/bin", **{k: v.replace(runtime.PYTHON_IN_SANDBOX, host) for k, v in staged.environment}}
    done = subprocess.run([f"{host}/bin/{version}", "-I", "-c", "import sys, json, ssl, sqlite3, ctypes; "
                           "print(sys.prefix); print([p for p in sys.path if 'site-packages' in p])"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    prefix, site_packages = done.stdout.splitlines()
    assert prefix == host and site_packages == "[]"  # no host packages come along


def test_a_stage_directory_someone_else_may_write_is_refused(tmp_path):
    shared = tmp_path / "arpo-sandbox-runtime"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="only it may write"):
        runtime._owned_directory(shared)
    shared.chmod(0o755)
    assert runtime._owned_directory(shared) == shared


def test_each_sandbox_gets_its_own_copy_of_the_package_without_byte_code(tmp_path):
    dest = runtime.copy_package(confinement.package_dir(), tmp_path / "lib")
    copied = {p.name for p in (dest / "desktop_sandbox").iterdir()}
    assert {"server.py", "session.py", "runtime.py", "openbox-rc.xml"} <= copied and "__pycache__" not in copied


def test_a_site_without_the_servers_packages_is_a_clear_error(tmp_path):
    """Modules copied without their .dist-info (no metadata) are not found: staging names what is
    missing instead of a sandbox that dies at start with an ImportError inside."""
    (tmp_path / "site" / "pyautogui").mkdir(parents=True)
    (tmp_path / "site" / "pyautogui" / "__init__.py").write_text("")
    with pytest.raises(RuntimeError, match=r"needs pyautogui, Xlib, PIL installed as a distribution"):
        runtime.stage((str(tmp_path / "site"),))
