"""The set-up fits the machine it runs on: the torch it installs or keeps (scripts/choose_torch.py),
what each role installs (scripts/setup.sh --dry-run against stand-in `nvidia-smi` programs and a
stand-in for Colab's interpreter), and a set-up with nothing to do never reaches apt."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _choose_torch():
    spec = importlib.util.spec_from_file_location("choose_torch", ROOT / "scripts" / "choose_torch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["choose_torch"] = module
    spec.loader.exec_module(module)
    return module


ct = _choose_torch()
FLOOR = ct.torch_floor()
A100 = ("NVIDIA A100-SXM4-40GB",)


def _choice(role="all", driver=None, base=None, **env):
    return ct.choose(role, ct.Driver(driver, A100) if driver else None, base or ct.BaseTorch(), FLOOR, env)


# --- the decision ---------------------------------------------------------------------------------

def test_the_floor_is_read_from_pyproject():
    assert FLOOR >= (2, 7)
    assert re.search(r'"torch>=' + ".".join(map(str, FLOOR)) + '"', (ROOT / "pyproject.toml").read_text())


def test_no_driver_installs_the_cpu_runnable_pair_from_pypi():
    choice = _choice()
    assert choice.action == "install" and choice.pip_args == ["torch==2.14.1", "torchvision==0.29.1"]
    assert "no NVIDIA driver" in choice.reason and not choice.layer_on_base


@pytest.mark.parametrize("driver, index", [("590.44.01", None), ("580.65.06", None),
                                           ("550.54.15", ct.CUDA12_INDEX), ("525.60.13", ct.CUDA12_INDEX)])
def test_a_driver_gets_the_build_it_can_run(driver, index):
    choice = _choice(driver=driver)
    assert choice.action == "install"
    assert choice.pip_args[:2] == ["torch==2.14.1", "torchvision==0.29.1"]
    assert choice.pip_args[2:] == ([] if index is None else ["--index-url", index])
    assert driver in choice.reason and ("CUDA 12.8" in choice.reason) == (index is not None)


def test_a_driver_too_old_for_any_supported_torch_is_an_error_naming_it_and_what_is_needed():
    choice = _choice(driver="470.256.02")
    assert choice.action == "error"
    assert "470.256.02" in choice.reason and "525.60.13" in choice.reason and "ARPO_TORCH=" in choice.reason


def test_a_working_cuda_torch_already_there_is_kept_and_pinned():
    colab = ct.BaseTorch("2.9.0+cu126", "12.6", True, "0.24.0+cu126")
    choice = _choice(driver="550.54.15", base=colab)
    assert choice.action == "keep" and choice.pip_args == [] and choice.layer_on_base
    assert choice.constraints == ["torch==2.9.0", "torchvision==0.24.0"]  # == matches the +cu126 build
    assert "keeping the torch 2.9.0+cu126" in choice.reason


@pytest.mark.parametrize("base, why", [
    (ct.BaseTorch("2.5.1+cu124", "12.4", True, "0.20.1"), "older than the workbench's floor"),
    (ct.BaseTorch("2.14.1+cu130", "13.0", False, "0.29.1"), "built for CUDA 13.0, which this driver cannot run"),
    (ct.BaseTorch("2.9.0+cpu", None, False, "0.24.0"), "a CPU build"),
    (ct.BaseTorch("2.9.0+cu126", "12.6", True, None), "without torchvision"),
    (ct.BaseTorch("2.9.0+cu126", "12.6", False, "0.24.0"), "unable to see the GPU"),
])
def test_a_torch_that_cannot_serve_is_not_kept_and_the_reason_says_why(base, why):
    choice = _choice(driver="550.54.15", base=base)
    assert choice.action == "install" and why in choice.reason and not choice.layer_on_base


def test_an_environment_host_gets_the_cpu_build_even_beside_a_driver():
    for driver in (None, "590.44.01"):
        choice = _choice(role="env", driver=driver)
        assert choice.pip_args[-2:] == ["--index-url", ct.CPU_INDEX], choice


def test_arpo_torch_names_the_build_and_arpo_torch_index_replaces_the_index():
    assert _choice(ARPO_TORCH="torch==2.9.1 --index-url https://x/y").pip_args == [
        "torch==2.9.1", "--index-url", "https://x/y"]
    assert _choice(driver="550.54.15", ARPO_TORCH_INDEX="https://mirror/cu128").pip_args[-1] == "https://mirror/cu128"


def test_nvidia_smi_is_read_for_the_driver_and_the_gpus(tmp_path):
    smi = _stand_in_smi(tmp_path, "550.54.15", gpus=2)
    driver = ct.read_driver(str(smi))
    assert driver == ct.Driver("550.54.15", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"))
    assert driver.cuda_major == 12
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n")
    broken.chmod(0o755)
    assert ct.read_driver(str(broken)) is None


# --- setup.sh's dry run -------------------------------------------------------------------------

def _stand_in_smi(directory: Path, version: str, gpus: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    smi = directory / "nvidia-smi"
    rows = "\\n".join([f"{version}, NVIDIA A100-SXM4-40GB"] * gpus)
    smi.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
    smi.chmod(0o755)
    return smi


def _checkout(tmp_path: Path) -> Path:
    """The files the set-up reads, without a .venv or models (a fresh clone, as far as it looks)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/choose_torch.py", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    return repo


def _colab_python(tmp_path: Path) -> Path:
    """An interpreter holding a CUDA torch that sees a GPU, as Colab's does (a stand-in module)."""
    env = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.9.0+cu126'\nclass version:\n    cuda = '12.6'\n"
        "class cuda:\n    @staticmethod\n    def is_available():\n        return True\n")
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text("__version__ = '0.24.0+cu126'\n")
    return env / "bin" / "python"


def _bare_python() -> str:
    """The base interpreter (no torch of its own), so that nothing of this machine decides."""
    return str(Path(sys.base_prefix) / "bin" / "python3")


def _dry_run(repo: Path, path_dirs: list[Path], *args: str, **env: str) -> str:
    env.setdefault("ARPO_PYTHON", _bare_python())
    environ = {k: v for k, v in os.environ.items() if k not in ("ARPO_SETUP_ROLE", "ARPO_PYTHON_ENV",
                                                                 "COLAB_RELEASE_TAG", "ARPO_TORCH")}
    environ["PATH"] = ":".join([*map(str, path_dirs), environ["PATH"]])
    environ.update(env)
    done = subprocess.run(["bash", "scripts/setup.sh", "--dry-run", *args], cwd=repo, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert not (repo / ".venv").exists(), "a dry run made the environment"
    return f"rc={done.returncode}\n{done.stdout}{done.stderr}"


def _no_smi_dir(tmp_path: Path) -> Path:
    """A PATH entry whose `nvidia-smi` fails as on a machine without a driver (one may be installed)."""
    d = tmp_path / "nodriver"
    d.mkdir(exist_ok=True)
    (d / "nvidia-smi").write_text("#!/bin/sh\nexit 127\n")
    (d / "nvidia-smi").chmod(0o755)
    return d


@pytest.mark.parametrize("driver, expect", [
    ("590.44.01", "install -q torch==2.14.1 torchvision==0.29.1\n"),
    ("550.54.15", "install -q torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu128"),
])
def test_the_dry_run_installs_the_torch_the_driver_runs(tmp_path, driver, expect):
    repo = _checkout(tmp_path)
    out = _dry_run(repo, [_stand_in_smi(tmp_path / "bin", driver).parent])
    assert out.startswith("rc=0"), out
    assert f"NVIDIA driver {driver}" in out and expect in out
    assert "would run: .venv/bin/python -m pip install -q -e .[notebooks,dev] -c .venv/.torch-constraints.txt" in out
    assert "building models/tiny-uitars-qwen2vl" in out


def test_the_dry_run_refuses_a_driver_too_old(tmp_path):
    out = _dry_run(_checkout(tmp_path), [_stand_in_smi(tmp_path / "bin", "470.256.02").parent])
    assert out.startswith("rc=1") and "ERROR: NVIDIA driver 470.256.02" in out and "pip install" not in out


def test_on_colab_the_set_up_keeps_its_torch_and_installs_into_its_interpreter(tmp_path):
    repo, colab = _checkout(tmp_path), _colab_python(tmp_path)
    out = _dry_run(repo, [_stand_in_smi(tmp_path / "bin", "550.54.15").parent],
                   ARPO_PYTHON=str(colab), COLAB_RELEASE_TAG="release-colab-20261201")
    assert out.startswith("rc=0"), out
    assert f"Python: {colab} (system)" in out and "keeping the torch 2.9.0+cu126" in out
    assert f"pointing .venv at {colab}" in out
    assert f"would run: {colab} -m pip install -q -e .[notebooks,dev]" in out
    assert "pip install -q torch" not in out and "torch==2.9.0 torchvision==0.24.0" in out


def test_a_training_node_installs_no_browser_or_desktop_and_a_host_of_environments_no_cuda_torch(tmp_path):
    repo = _checkout(tmp_path)
    empty_path = tmp_path / "nothing"  # a machine with none of the system packages
    empty_path.mkdir()
    for tool in ("bash", "sh", "cat", "sha256sum", "cut", "head", "mktemp", "dirname", "id", "sed", "grep", "env"):
        if shutil.which(tool):
            (empty_path / tool).symlink_to(shutil.which(tool))
    smi = _stand_in_smi(tmp_path / "bin", "590.44.01").parent
    base = {"PATH": f"{smi}:{empty_path}", "ARPO_SKIP_UBUNTU_FONT": "1"}
    train = _dry_run(repo, [], "--role", "train", **base)
    assert train.startswith("rc=0"), train
    assert "apt-get" not in train and "chromium" not in train and "gnome-shell" not in train
    assert "torch==2.14.1 torchvision==0.29.1\n" in train
    env = _dry_run(repo, [], "--role", "env", **base)
    assert env.startswith("rc=0"), env
    assert "apt-get install" in env and "chromium" in env and "gnome-shell" in env
    assert "--index-url https://download.pytorch.org/whl/cpu" in env and "install -q -e .[dev]" in env
    assert env.count("apt-get update") == 1  # one update for every group it installs


# --- nothing to do, nothing done ----------------------------------------------------------------

SHELL_SCRIPTS = [ROOT / "workbench", *sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run"]


def test_no_set_up_script_pipes_a_presence_check_into_grep_q():
    """Under pipefail, `producer | grep -q` fails when grep exits at its first match and the
    producer gets SIGPIPE: a present library would read as missing, and the set-up reach apt."""
    found = [f"{path.name}:{n}: {line.strip()}" for path in SHELL_SCRIPTS
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\|\s*grep\s+-\w*q", line) and not line.lstrip().startswith("#")]
    assert not found, found


@pytest.mark.skipif(not (ROOT / ".venv" / ".arpo-role").exists(), reason="needs a finished ./workbench setup")
def test_a_set_up_with_nothing_to_do_never_reaches_apt_or_pip(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    trap = tmp_path / "bin"
    trap.mkdir()
    for tool in ("apt-get", "apt", "sudo", "dpkg", "wget"):
        (trap / tool).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marks}/{tool}\nexit 1\n")
        (trap / tool).chmod(0o755)
    subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, check=True, capture_output=True)  # up to date first
    env = {**os.environ, "PATH": f"{trap}:{os.environ['PATH']}"}
    # inside the activated environment (a notebook's kernel, a ./workbench command) as outside it
    inside = {**env, "PATH": f"{trap}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(ROOT / ".venv")}
    for i in range(40):  # the pipefail race fired 4 times in 200 runs: a loop catches a regression
        done = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=inside if i % 2 else env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not list(marks.iterdir()), (done.stderr, [p.read_text() for p in marks.iterdir()])
        assert "installing" not in done.stderr, done.stderr


# --- Colab's path: the notebooks' install cell --------------------------------------------------

def _tree_copy(dest: Path) -> Path:
    """The repository as a clone of it holds it (tracked and new files, not what git ignores)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _stand_in_colab(tmp_path: Path) -> Path:
    """An interpreter with a preinstalled stack, as Colab's: a bare venv that sees this environment's
    packages (torch, transformers, jupyter) through a .pth file, and installs into its own."""
    env = tmp_path / "colab-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3*/site-packages"))
    import sysconfig

    (site / "preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env / "bin" / "python"


@pytest.mark.slow
def test_the_notebooks_install_cell_sets_up_a_fresh_checkout_in_colabs_interpreter(tmp_path):
    """The first code cell after the parameters, run with papermill from a fresh copy of the
    repository, in a kernel of a stand-in for Colab's interpreter: the workbench installs into that
    interpreter (system mode, its torch kept), .venv runs the same interpreter, the tiny models the
    defaults use are built; run again, it does nothing."""
    import json

    import papermill

    clone = _tree_copy(tmp_path / "clone")
    colab = _stand_in_colab(tmp_path)
    nb = json.loads((clone / "notebooks" / "evaluation.ipynb").read_text())
    first = next(i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", []))
    nb["cells"] = nb["cells"][:first + 2]  # up to the install cell
    assert "".join(nb["cells"][-1]["source"]).startswith("# Set-up, for Colab")
    nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "after", "metadata": {}, "outputs": [],
                        "source": ["import sys, arpo_lib\n", "print('kernel:', sys.prefix, arpo_lib.__file__)"]})
    (clone / "notebooks" / "install_only.ipynb").write_text(json.dumps(nb))
    kernels = tmp_path / "jupyter" / "kernels" / "colab"  # the notebook's kernel runs Colab's interpreter
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(colab), "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "Colab",
        "language": "python"}))
    env = {"COLAB_RELEASE_TAG": "release-colab-stand-in", "ARPO_PYTHON": str(colab), "ARPO_SKIP_UBUNTU_FONT": "1",
           "JUPYTER_PATH": str(tmp_path / "jupyter")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for attempt in range(2):
            out = tmp_path / f"out{attempt}.ipynb"
            papermill.execute_notebook(str(clone / "notebooks" / "install_only.ipynb"), str(out), kernel_name="colab",
                                       cwd=str(clone / "notebooks"), progress_bar=False)
            text = "".join("".join(o.get("text", "")) for c in json.loads(out.read_text())["cells"]
                           for o in c.get("outputs", []))
            assert f"kernel: {colab.parent.parent} {clone}/arpo_lib/__init__.py" in text, text
            if attempt == 0:
                assert f"Python: {colab} (system)" in text and "building models/tiny-uitars-qwen2vl" in text, text
            else:
                assert text.startswith("kernel:"), text  # set up: nothing to do, nothing said
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    for model in ("tiny-uitars-qwen2vl", "tiny-uitars-qwen25vl", "small-uitars-qwen2vl"):
        assert (clone / "models" / model / ".complete").is_file()
    ran = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                          "import sys, arpo_lib, torch; print(sys.prefix); print(arpo_lib.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert ran[0] == str(colab.parent.parent) and ran[1].startswith(str(clone))  # Colab's interpreter, the clone's code
