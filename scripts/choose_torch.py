"""Which torch the set-up should give the workbench on this machine, and why (standard library only:
it runs with the base interpreter before any environment exists).

    python scripts/choose_torch.py --role all [--python /usr/bin/python3]     # shell lines for setup.sh

The decision, in order:
1. A role that only hosts environments (`env`) never gets a CUDA build: torch's CPU wheels.
2. No NVIDIA driver (no `nvidia-smi`, or it fails): the CPU-runnable pair this project's CI machines
   hold (`torch==2.14.1`, `torchvision==0.29.1`; on PyPI a CUDA 13 build that also runs on a CPU).
3. A driver, and the base interpreter already has a torch that is new enough, built for a CUDA the
   driver can run, and sees a GPU (Colab's, a cluster's module): it is kept, with its torchvision,
   and the workbench's environment is layered on that interpreter (`--system-site-packages`).
4. A driver new enough for CUDA 13 (>= 580.65.06): PyPI's pair (CUDA 13.0).
5. A driver new enough for CUDA 12 (>= 525.60.13; CUDA 12's minor-version compatibility lets
   every 12.x wheel run on it): the same versions from PyTorch's CUDA 12.8 index.
6. An older driver: an error naming the driver, the newest CUDA it runs and what is needed.

`ARPO_TORCH` (pip requirement words, e.g. `torch==2.9.1 torchvision==0.24.1 --index-url URL`) skips
the decision; `ARPO_TORCH_INDEX` replaces the index of rule 1 or 5.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PAIR = ("2.14.1", "0.29.1")
"""The torch and torchvision versions the set-up installs when it installs them."""

CUDA13_DRIVER = (580, 65, 6)
"""The oldest Linux driver that runs CUDA 13.0 (NVIDIA's CUDA release notes, table 3)."""
CUDA12_DRIVER = (525, 60, 13)
"""The oldest Linux driver that runs every CUDA 12.x build (minor-version compatibility)."""
CUDA11_DRIVER = (450, 80, 2)

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA12_INDEX = "https://download.pytorch.org/whl/cu128"

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Driver:
    """What `nvidia-smi` says about the machine's NVIDIA driver and GPUs."""

    version: str
    """e.g. 550.54.15"""
    gpus: tuple[str, ...] = ()
    """one name per GPU, e.g. NVIDIA A100-SXM4-40GB"""

    @property
    def parts(self) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", self.version)[:3])

    @property
    def cuda_major(self) -> int:
        """The newest CUDA major version this driver runs (0: none the workbench supports)."""
        if self.parts >= CUDA13_DRIVER:
            return 13
        if self.parts >= CUDA12_DRIVER:
            return 12
        if self.parts >= CUDA11_DRIVER:
            return 11
        return 0


@dataclass(frozen=True)
class BaseTorch:
    """The torch the base interpreter already has (absent: version None)."""

    version: str | None = None
    cuda: str | None = None
    """torch.version.cuda: None for a CPU build"""
    cuda_available: bool = False
    torchvision: str | None = None


@dataclass
class Choice:
    """What the set-up does about torch: `keep` the base interpreter's, `install` pip words, or `error`."""

    action: str
    reason: str
    pip_args: list[str] = field(default_factory=list)
    """requirement words for `pip install` (empty unless action is install)"""
    constraints: list[str] = field(default_factory=list)
    """pins that keep a kept torch in place while the rest installs"""
    layer_on_base: bool = False
    """True: the environment sees the base interpreter's packages (--system-site-packages)"""

    def shell(self) -> str:
        """Lines setup.sh evaluates."""
        return "\n".join([
            f"TORCH_ACTION={shlex.quote(self.action)}",
            f"TORCH_REASON={shlex.quote(self.reason)}",
            f"TORCH_PIP_ARGS=({' '.join(shlex.quote(a) for a in self.pip_args)})",
            f"TORCH_CONSTRAINTS=({' '.join(shlex.quote(c) for c in self.constraints)})",
            f"TORCH_LAYER_ON_BASE={int(self.layer_on_base)}",
        ])


def torch_floor(pyproject: Path = ROOT / "pyproject.toml") -> tuple[int, ...]:
    """The oldest torch the project supports: its `torch>=X` requirement in pyproject.toml."""
    match = re.search(r'"torch>=([\d.]+)"', pyproject.read_text(encoding="utf-8"))
    return _version(match.group(1)) if match else (0,)


def _public(version: str) -> str:
    """A version without its local label ("2.8.0+cu126" -> "2.8.0"): `==` on it matches every build."""
    return version.split("+")[0]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def read_driver(nvidia_smi: str | None = None) -> Driver | None:
    """The driver, from `nvidia-smi --query-gpu` (None: no NVIDIA driver, or it does not answer)."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",", 1)] for line in out.splitlines() if line.strip()]
    if not rows or not re.match(r"^\d+\.\d+", rows[0][0]):
        return None
    return Driver(rows[0][0], tuple(r[1] if len(r) > 1 else "?" for r in rows))


PROBE = ("import json\ntry:\n import torch\nexcept Exception:\n print(json.dumps({}))\nelse:\n"
         " try:\n  import torchvision; tv = torchvision.__version__\n except Exception:\n  tv = None\n"
         " print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda,"
         " 'cuda_available': bool(torch.cuda.is_available()), 'torchvision': tv}))\n")


def read_base_torch(python: str) -> BaseTorch:
    """The torch an interpreter holds (importing it: a few seconds)."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300).stdout
        found = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        found = {}
    return BaseTorch(**found)


def _pair(index: str | None) -> list[str]:
    words = [f"torch=={PAIR[0]}", f"torchvision=={PAIR[1]}"]
    return words + (["--index-url", index] if index else [])


def choose(role: str, driver: Driver | None, base: BaseTorch, floor: tuple[int, ...],
           environ: dict[str, str] | None = None) -> Choice:
    """The decision of this module's docstring, as a pure function of what was found."""
    environ = dict(os.environ if environ is None else environ)
    if environ.get("ARPO_TORCH"):
        return Choice("install", "ARPO_TORCH names the build", shlex.split(environ["ARPO_TORCH"]))
    if role == "env":
        index = environ.get("ARPO_TORCH_INDEX", CPU_INDEX)
        return Choice("install", "an environment host runs no model on a GPU: torch's CPU build "
                      f"({PAIR[0]}, from {index})", _pair(index))
    if driver is None:
        return Choice("install", f"no NVIDIA driver (no working nvidia-smi): torch {PAIR[0]} and torchvision "
                      f"{PAIR[1]} from PyPI (they run on the CPU)", _pair(None))
    gpus = f"{len(driver.gpus)} x {driver.gpus[0]}" if driver.gpus else "a GPU"
    runs = {13: "CUDA 13 and 12", 12: "CUDA 12", 11: "CUDA 11", 0: "no CUDA"}[driver.cuda_major]
    about = f"NVIDIA driver {driver.version} ({gpus}; runs {runs})"
    floor_text = ".".join(map(str, floor))
    if base.version:
        built = _version(base.cuda or "0")[:1]
        fits = bool(base.cuda) and built[0] <= driver.cuda_major and built[0] >= 11
        new_enough = _version(base.version) >= floor
        if fits and new_enough and base.cuda_available and base.torchvision:
            return Choice("keep", f"{about}: keeping the torch {base.version} (CUDA {base.cuda}) and torchvision "
                          f"{base.torchvision} already installed", [],
                          [f"torch=={_public(base.version)}", f"torchvision=={_public(base.torchvision)}"], layer_on_base=True)
        why = ("older than the workbench's floor " + floor_text if not new_enough
               else "a CPU build" if not base.cuda
               else f"built for CUDA {base.cuda}, which this driver cannot run" if not fits
               else "without torchvision" if not base.torchvision
               else "unable to see the GPU (torch.cuda.is_available() is False)")
        about += f"; the torch {base.version} already installed is {why}, so it is not used"
    if driver.cuda_major >= 13:
        return Choice("install", f"{about}: torch {PAIR[0]} from PyPI (CUDA 13.0)", _pair(None))
    if driver.cuda_major == 12:
        index = environ.get("ARPO_TORCH_INDEX", CUDA12_INDEX)
        return Choice("install", f"{about}: torch {PAIR[0]} built for CUDA 12.8 (from {index}); a driver >= "
                      f"{'.'.join(map(str, CUDA13_DRIVER))} would take PyPI's CUDA 13 build", _pair(index))
    return Choice("error", f"{about}: torch {PAIR[0]} needs CUDA 12 (driver >= {'.'.join(map(str, CUDA12_DRIVER))}) "
                  "or CUDA 13 (driver >= " + ".".join(map(str, CUDA13_DRIVER)) + "). Update the NVIDIA driver, or "
                  "name a build yourself: ARPO_TORCH='torch==X torchvision==Y --index-url URL' (the workbench needs "
                  f"torch >= {floor_text}, which no CUDA 11 build of torch has)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="all", choices=["all", "train", "env"])
    parser.add_argument("--python", default=sys.executable, help="the base interpreter whose torch may be kept")
    parser.add_argument("--json", action="store_true", help="print the decision as JSON instead of shell lines")
    args = parser.parse_args(argv)
    driver = read_driver()
    base = read_base_torch(args.python) if driver is not None and args.role != "env" else BaseTorch()
    choice = choose(args.role, driver, base, torch_floor())
    print(json.dumps(choice.__dict__) if args.json else choice.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main())
