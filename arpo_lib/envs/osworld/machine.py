"""Where OSWorld runs on this machine: the workbench's cache, OSWorld's interpreter and VM image
(`find_osworld_python`, `default_vm_path`), the Docker provider's preflight (engine, image, KVM,
the VM disk) and the cleanup of cache directories left by environments that died
(`remove_stale_cache_dirs`). The environment itself: env.py.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import socket
import sys
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

DOCKER_IMAGE = "happysixd/osworld-docker"
"""The image OSWorld's Docker provider runs each VM in."""
KVM_DEVICE = "/dev/kvm"
SETUP_SCRIPT = "scripts/setup_osworld.sh"
VM_IMAGE_NAMES = {"Ubuntu": "Ubuntu.qcow2", "Windows": "Windows-10-x64.qcow2"}
"""Disk image file names of OSWorld's Docker VMs, by `os_type`."""
CONTAINER_FILE = "container_id"
"""Written in an environment's cache dir while its VM container runs (for stale clean-up)."""

class OSWorldSetupError(ValueError):
    """OSWorld cannot run on this machine as configured (no Docker engine, no KVM, no VM image,
    options the DesktopEnv rejects). A ValueError so that environment workers classify it as a
    set-up error (`worker._is_setup_error`) and stop the run with this message: retrying, as for
    an `EnvError`, would not help."""


# --------------------------------------------------------------------------------------------
# Where things live
# --------------------------------------------------------------------------------------------

def workbench_cache() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/arpo-workbench`: venvs, VM image and cache dirs live here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "arpo-workbench"


def osworld_venv() -> Path:
    """The virtual environment scripts/setup_osworld.sh builds ($ARPO_OSWORLD_VENV overrides)."""
    return Path(os.environ.get("ARPO_OSWORLD_VENV") or workbench_cache() / "venv-osworld")


def default_vm_path(os_type: str = "Ubuntu") -> Path:
    """The VM disk image used when `path_to_vm` is not given ($ARPO_OSWORLD_VM overrides); the
    setup script's `--vm` downloads the Ubuntu one here."""
    if os.environ.get("ARPO_OSWORLD_VM"):
        return Path(os.environ["ARPO_OSWORLD_VM"]).expanduser()
    return workbench_cache() / "osworld-vm" / VM_IMAGE_NAMES.get(os_type, f"{os_type}.qcow2")


def find_osworld_python() -> str | None:
    """The Python interpreter that has desktop_env: $ARPO_OSWORLD_PYTHON, else this interpreter if
    it can import desktop_env, else the setup script's venv if it exists; None otherwise."""
    if os.environ.get("ARPO_OSWORLD_PYTHON"):
        return os.environ["ARPO_OSWORLD_PYTHON"]
    if importlib.util.find_spec("desktop_env") is not None:
        return sys.executable
    python = osworld_venv() / "bin" / "python"
    return str(python) if python.exists() else None


# --------------------------------------------------------------------------------------------
# Preflight (provider "docker")
# --------------------------------------------------------------------------------------------

def preflight_docker(path_to_vm: str | os.PathLike | None = None, os_type: str = "Ubuntu",
                     allow_no_kvm: bool = False) -> str:
    """Check that OSWorld's Docker provider can boot a VM here; returns the VM image's absolute path.

    Raises ImportError (no docker package) or OSWorldSetupError (engine unreachable, image not
    pulled, no /dev/kvm unless `allow_no_kvm`, no VM disk image), each saying what to do.
    """
    try:
        import docker
    except ImportError as e:
        raise ImportError(
            f"The `docker` Python package is missing in {sys.executable}: OSWorld's Docker provider "
            f"needs it. It comes with desktop-env: run `bash {SETUP_SCRIPT}` and use its interpreter "
            f"for the environment workers.") from e
    client = None
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(DOCKER_IMAGE)
    except docker.errors.ImageNotFound as e:
        raise OSWorldSetupError(
            f"The Docker image {DOCKER_IMAGE} is not pulled: run `docker pull {DOCKER_IMAGE}` "
            f"(or `bash {SETUP_SCRIPT} --vm`). Pulling it inside the first reset would exceed "
            f"the environment workers' timeout.") from e
    except Exception as e:
        raise OSWorldSetupError(
            f"The Docker engine is not usable from this process ({type(e).__name__}: {e}). Start it "
            f"(`sudo systemctl start docker`) and let this user reach it (group `docker`, or "
            f"DOCKER_HOST): OSWorld runs every VM as a container.") from e
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    if not os.path.exists(KVM_DEVICE):
        message = (f"{KVM_DEVICE} does not exist: OSWorld's VM would run in QEMU without hardware "
                   f"virtualisation, so slowly that boots time out (the provider waits 300 s). Enable "
                   f"KVM (virtualisation in the BIOS, nested virtualisation on a cloud VM, "
                   f"`modprobe kvm_intel` or `kvm_amd`), or pass allow_no_kvm=True to try anyway.")
        if not allow_no_kvm:
            raise OSWorldSetupError(message)
        warnings.warn(message, stacklevel=2)
    elif not os.access(KVM_DEVICE, os.R_OK | os.W_OK):
        warnings.warn(f"{KVM_DEVICE} is not readable and writable by this user: fine with a root Docker "
                      f"daemon (it hands the device to the container), not with rootless Docker "
                      f"(add the user to group `kvm`).", stacklevel=2)

    vm = Path(path_to_vm).expanduser() if path_to_vm else default_vm_path(os_type)
    if not vm.is_file():
        raise OSWorldSetupError(
            f"The OSWorld VM disk image {vm} does not exist. `bash {SETUP_SCRIPT} --vm` downloads the "
            f"Ubuntu image to {default_vm_path('Ubuntu')}; or pass path_to_vm= (or set ARPO_OSWORLD_VM).")
    return str(vm.resolve())


# --------------------------------------------------------------------------------------------
# Per-environment cache directories
# --------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _remove_container(container_id: str) -> bool:
    """Force-remove a VM container; True if it is gone (or never existed)."""
    try:
        import docker

        client = docker.from_env()
    except Exception:
        return False
    try:
        client.containers.get(container_id).remove(force=True)
    except docker.errors.NotFound:
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            client.close()
    return True


def remove_stale_cache_dirs(cache_root: str | os.PathLike) -> list[Path]:
    """Delete the per-environment cache dirs that dead processes of this host left in `cache_root`
    (a killed worker never runs `close`), first force-removing the VM container each recorded.
    A dir whose container cannot be removed (no Docker here) is kept. Returns the deleted dirs."""
    host = socket.gethostname()
    removed = []
    for path in Path(cache_root).glob(f"{host}-*"):
        pid = path.name[len(host) + 1:].split("-", 1)[0]
        if not path.is_dir() or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        container = path / CONTAINER_FILE
        if container.exists() and not _remove_container(container.read_text().strip()):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
