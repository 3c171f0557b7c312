"""The sandbox's own Python, staged on the host so that the agent sees nothing of the host's layout.

Inside a namespaces-mode sandbox the action server, the agent's checked actions and the `python`
shims of OSWorld's commands run one interpreter. Binding the host's installation in place would
show the agent the checkout, its virtual environment, the home it lives in and, from the OSWorld
interpreter, desktop_env's evaluators (the checkers its episode is scored by). So the sandbox sees:

- /opt/arpo/python: the interpreter and its standard library (without site-packages, tests, IDLE,
  turtle demos), staged once per host in `<tmp>/arpo-sandbox-runtime-<uid>/<key>` by hard links where the
  file system allows (copies otherwise); an interpreter under /usr (Debian's, Ubuntu's, Colab's,
  a python Docker image's) is visible already and is used where it is.
- /opt/arpo/site: the files of the distributions the in-sandbox side imports (`DISTRIBUTIONS` and
  what they require), staged beside it. Nothing else of the host's site directories.
- /opt/arpo/lib/desktop_sandbox: a copy of this package made for each sandbox (sandbox.py).

The stage's key hashes the interpreter and the distributions' versions and files, so a changed
environment stages anew; a stage is complete when its directory exists (built under a temporary
name, then renamed). The mount table inside (/proc/self/mountinfo) still names each bind's source,
which is then a path under the host's temporary directory named after this project, and the
sandbox's own work directory: neither says where the checkout, the environments or the home are.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

INSIDE = "/opt/arpo"
PYTHON_IN_SANDBOX = f"{INSIDE}/python"
SITE_IN_SANDBOX = f"{INSIDE}/site"
LIB_IN_SANDBOX = f"{INSIDE}/lib"
"""Where the sandbox sees the interpreter, the staged distributions and this package's copy."""

DISTRIBUTIONS = ("PyAutoGUI", "python-xlib", "Pillow", "pyperclip", "pyseccomp")
"""What the in-sandbox side imports (the action server, the agent's pyautogui actions, OSWorld's
`python -c "import pyautogui; ..."` commands), with their requirements; those not installed are left out."""

REQUIRED_MODULES = ("pyautogui", "Xlib", "PIL")
"""Without these the sandbox's server cannot run: staging says so rather than a sandbox failing at start."""

STDLIB_LEFT_OUT = {"site-packages", "dist-packages", "test", "idlelib", "turtledemo", "ensurepip",
                   "lib2to3"}
"""Standard-library directories the sandbox's interpreter does without (the first two are where
the host's packages are)."""

SYSTEM_PREFIXES = ("/usr/",)
"""Host trees the sandbox sees anyway (confinement.SYSTEM_TREES): an interpreter there is used in place."""


@dataclass(frozen=True)
class Runtime:
    """What the sandbox's Python is, outside (host paths to bind) and inside (what to run)."""

    binds: tuple[tuple[str, str], ...]
    """(host path, path inside), read-only."""
    python: str
    """The interpreter inside the sandbox."""
    site: tuple[str, ...]
    """Directories inside the sandbox to put on sys.path (the staged site, system ones)."""
    environment: tuple[tuple[str, str], ...] = ()
    """What the interpreter needs in its environment (LD_LIBRARY_PATH for a relocated libpython)."""


def _base_executable() -> Path:
    """The interpreter a virtual environment was made from (this one outside a venv)."""
    return Path(getattr(sys, "_base_executable", sys.executable))


def _stage_root() -> Path:
    return _owned_directory(Path(tempfile.gettempdir()) / f"arpo-sandbox-runtime-{os.geteuid()}")


def _owned_directory(path: Path) -> Path:
    """`path` made (0755) or found as a directory of this user that nobody else may write."""
    path.mkdir(mode=0o755, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not a directory of this user that only it may write: "
                           "the sandbox's Python cannot be staged there (remove it)")
    return path


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names of what `dist` requires on this interpreter (extras and other platforms' left out)."""
    names = []
    for line in dist.requires or []:
        spec, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        if marker.strip():
            try:
                from packaging.markers import Marker
                if not Marker(marker.strip()).evaluate():
                    continue
            except ImportError:  # without packaging: kept (a name not installed is skipped anyway)
                pass
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if match:
            names.append(match.group(1))
    return names


def distributions(site_dirs: list[str], roots: tuple[str, ...] = DISTRIBUTIONS) -> list[metadata.Distribution]:
    """The installed distributions among `roots` and everything they require, found in `site_dirs`."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        dist = next(iter(metadata.distributions(name=name, path=site_dirs)), None)
        if dist is not None:
            found[name] = dist
            todo += _requirements(dist)
    return [found[k] for k in sorted(found)]


def _site_of(dist: metadata.Distribution) -> Path:
    return Path(str(dist.locate_file(""))).resolve()


def _dist_files(dist: metadata.Distribution) -> list[tuple[Path, Path]]:
    """(file on the host, path relative to its site directory) of each file `dist` installed there."""
    site = _site_of(dist)
    pairs = []
    for entry in dist.files or []:
        path = Path(str(dist.locate_file(entry))).resolve()
        if path.is_file() and path.is_relative_to(site):
            pairs.append((path, path.relative_to(site)))
    return pairs


def _place(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dest)
        return
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _stdlib_files(prefix: Path) -> list[tuple[Path, Path]]:
    """(file, path relative to the prefix) of the interpreter, its shared libraries and standard library."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pairs = []
    exe = _base_executable().resolve()
    pairs.append((exe, Path("bin") / version))
    lib = prefix / "lib"
    for entry in lib.iterdir():  # libpython and, for conda-like installations, what lib-dynload links
        if entry.is_file() and ".so" in entry.name:
            pairs.append((entry, Path("lib") / entry.name))
    stdlib = lib / version
    for dirpath, dirnames, filenames in os.walk(stdlib):
        if Path(dirpath) == stdlib:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_LEFT_OUT and not d.startswith("config-")]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                pairs.append((path, path.relative_to(prefix)))
    return pairs


def _key(parts: list[tuple[Path, Path]]) -> str:
    digest = hashlib.sha256(sys.version.encode())
    for src, rel in sorted(parts, key=lambda p: str(p[1])):
        st = src.lstat()
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _stage(root: Path, name: str, parts: list[tuple[Path, Path]]) -> Path:
    """`root/name` holding `parts`, built once: under a temporary name, then renamed."""
    final = root / name
    if final.is_dir():
        return final
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        for src, rel in parts:
            _place(src, building / rel)
        building.chmod(0o755)
        for dirpath, dirnames, _ in os.walk(building):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        try:
            os.rename(building, final)
        except OSError:  # another process staged the same one meanwhile
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final


def _system(path: str) -> bool:
    return any(path.startswith(p) for p in SYSTEM_PREFIXES)


@functools.lru_cache(maxsize=8)
def stage(site_dirs: tuple[str, ...]) -> Runtime:
    """The sandbox's Python for this interpreter, its stage made if missing (see the module docstring)."""
    root = _stage_root()
    binds: list[tuple[str, str]] = []
    environment: list[tuple[str, str]] = []
    prefix = Path(sys.base_prefix).resolve()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if _system(str(prefix) + "/"):
        python = str(_base_executable().resolve())
    else:
        parts = _stdlib_files(prefix)
        staged = _stage(root, f"python-{_key(parts)}", parts)
        binds.append((str(staged), PYTHON_IN_SANDBOX))
        python = f"{PYTHON_IN_SANDBOX}/bin/{version}"
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):  # its libpython, wherever its RUNPATH said
            environment.append(("LD_LIBRARY_PATH", f"{PYTHON_IN_SANDBOX}/lib"))
    site: list[str] = []
    files: list[tuple[Path, Path]] = []
    for dist in distributions(list(site_dirs)):
        where = str(_site_of(dist))
        if _system(where + "/"):
            if where not in site:
                site.append(where)
        else:
            files += _dist_files(dist)
    staged_modules = {rel.parts[0].removesuffix(".py") for _, rel in files}
    missing = [m for m in REQUIRED_MODULES if m not in staged_modules
               and not any(os.path.exists(os.path.join(d, m)) for d in site)]
    if missing:
        raise RuntimeError(f"the sandbox's Python needs {', '.join(missing)} installed as a distribution (with its "
                           f".dist-info) in this interpreter ({sys.executable}): `./workbench setup` installs them")
    if files:
        files = list({rel: (src, rel) for src, rel in reversed(files)}.values())  # one file per path (python-xlib
        # and python3-xlib both install Xlib/): the first distribution's
        staged_site = _stage(root, f"site-{_key(files)}", files)
        binds.append((str(staged_site), SITE_IN_SANDBOX))
        site.insert(0, SITE_IN_SANDBOX)
    return Runtime(tuple(binds), python, tuple(site), tuple(environment))


def _tree_files(top: Path) -> list[tuple[Path, Path]]:
    """(file or link, path relative to `top`) of everything under `top` but directories; a link
    that leaves the tree (absolute, or climbing out of it) is refused."""
    pairs = []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = Path(dirpath) / name
            if path.is_symlink():
                target = os.readlink(path)
                if os.path.isabs(target) or not (path.parent / target).resolve().is_relative_to(top.resolve()):
                    raise RuntimeError(f"{path} links outside {top} ({target}): it would not resolve in the sandbox")
            elif not path.is_file():
                continue
            pairs.append((path, path.relative_to(top)))
    return pairs


@functools.lru_cache(maxsize=8)
def stage_tree(top: str, name: str) -> str:
    """A read-only copy of the directory `top` in the stage (hard links where the file system
    allows), for a program installed under a home the sandbox's uid cannot enter (VS Code's, under
    the workbench's cache); the host path to bind."""
    root = _stage_root()
    parts = _tree_files(Path(top))
    return str(_stage(root, f"{name}-{_key(parts)}", parts))


def copy_package(package: str, dest: Path) -> Path:
    """A copy of the package directory `package` (its files, no byte code) at `dest/<its name>`,
    for one sandbox; returns `dest`, bound at LIB_IN_SANDBOX. World-readable whatever the umask
    and the checkout's modes: started by root, the sandbox's user is an unprivileged uid, which
    must read it (else the sandbox's user maps to root)."""
    shutil.copytree(package, dest / Path(package).name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest
