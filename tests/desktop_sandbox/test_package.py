"""The desktop sandbox is a package of its own: it imports nothing of arpo_lib, so an OSWorld user
outside the workbench can run it, and the sandbox's own server sees only this package."""
import ast
import subprocess
import sys
from pathlib import Path

import desktop_sandbox

PACKAGE = Path(desktop_sandbox.__file__).parent


def test_no_module_of_the_package_names_arpo_lib_in_an_import():
    """Every import statement, top-level or inside a function, annotation-only ones included."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "arpo_lib"]
    assert not offenders, offenders
    assert len(list(PACKAGE.glob("*.py"))) >= 12  # the scan saw the package


def test_every_module_imports_with_arpo_lib_unimportable():
    """Imported for real with arpo_lib made unimportable (a finder that refuses it), the way the
    sandbox's isolated server interpreter sees the host: only this package's directory."""
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    script = (
        "import importlib, importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'arpo_lib': raise ImportError('arpo_lib is not here')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        f"for m in {modules!r}: importlib.import_module('desktop_sandbox.' + m)\n"
        "import desktop_sandbox; desktop_sandbox.Sandbox, desktop_sandbox.SandboxError\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'arpo_lib']\n"
        "print('ok', len(sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


def test_importing_the_package_for_the_action_check_starts_nothing():
    """arpo_lib's converter imports `action_code` from here: that must not import the sandbox."""
    done = subprocess.run([sys.executable, "-c", "import sys, desktop_sandbox.action_code; "
                           "print(sorted(m for m in sys.modules if m.startswith('desktop_sandbox')))"],
                          cwd=PACKAGE.parent, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "['desktop_sandbox', 'desktop_sandbox.action_code']", done.stderr[-1000:]


def test_the_package_ships_its_readme_threat_model_and_configs():
    for name in ("README.md", "THREAT_MODEL.md", "openbox-rc.xml", "dbus-session.conf"):
        assert (PACKAGE / name).is_file(), name
    readme = (PACKAGE / "README.md").read_text()
    assert "desktop_sandbox.osworld" in readme and "SandboxDesktopEnv" in readme
