"""Fetching a Hugging Face checkpoint into the machine's one Hugging Face cache, and saying what the
workbench will make of it (`./workbench fetch-model NAME`).

The cache is huggingface_hub's own (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
~/.cache/huggingface/hub): every rank, server and notebook on the machine reads the same copy, and
transformers and vLLM resolve a hub id (`model.path=ByteDance-Seed/UI-TARS-1.5-7B`) through it.
The download is huggingface_hub's `snapshot_download` (progress bars, `HF_TOKEN`, files already
cached are skipped); before it, the file sizes from the hub's metadata and the cache's free space
decide whether it can start at all.

On resuming: huggingface_hub (2.x) resumes a file whose connection drops, within the same command
(a new request with a Range header, up to five times without progress). A command that is itself
interrupted keeps every finished file, but starts an unfinished one over: each download writes
its own temporary file and deletes it on failure.

The report reads the downloaded checkpoint through the loaders the workbench itself uses
(`CheckpointLoaders`, handed in by the caller: this ground-floor module imports nothing of ours).
huggingface_hub is imported inside the functions, where it is used.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

DISK_HEADROOM = 0.02
"""Free space kept beyond the download, as a share of it: the disk is not filled to the last byte."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
COORDINATES = {"qwen25vl": "absolute pixels of the smart-resized screenshot",
               "qwen2vl": "relative, 0..1000 per axis"}
"""What each coordinate convention (`model.coord_mode`) means, for the report."""


class FetchModelError(RuntimeError):
    """The checkpoint cannot be fetched; the message says why and what to do."""


class HubAccessError(FetchModelError):
    """The hub refused the repository (401/403, gated, private or not found)."""


class NotEnoughDiskError(FetchModelError):
    """The cache's disk cannot hold the files still to download."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    """Path inside the repository."""
    size: int
    """Bytes, from the hub's file metadata."""


@dataclass(frozen=True)
class RemoteModel:
    """A repository at one commit, as the hub lists it."""

    repo_id: str
    revision: str
    """What was asked for (a branch, tag or commit)."""
    commit: str
    """The commit it names now."""
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_files(self) -> tuple[RemoteFile, ...]:
        return tuple(f for f in self.files if f.path.endswith(WEIGHT_SUFFIXES))


@dataclass(frozen=True)
class CheckpointLoaders:
    """How the workbench loads a checkpoint (arpo_lib.agent's functions); the report says what they
    make of the downloaded files."""

    load_processor: Callable[[str], Any]
    """Path -> the processor (agent.prompt.load_processor: adapts what transformers refuses)."""
    coord_mode_for: Callable[[str], str]
    """Path -> the coordinate convention `model.coord_mode=auto` picks (agent.prompt.coord_mode_for)."""
    image_processor_limits: Callable[[Any], tuple[int, int, int]]
    """Processor -> (factor, min_pixels, max_pixels) it resizes with."""
    sampling_defaults: Callable[[Any], dict[str, Any]]
    """Generation config -> the sampling settings it sets away from neutral
    (agent.hf_policy.checkpoint_sampling_defaults)."""


# ----------------------------------------------------------------------------- where, how big

def hub_cache_dir(explicit: str | Path | None = None) -> Path:
    """The Hugging Face hub cache, by huggingface_hub's own rule, read from the environment now
    (huggingface_hub reads it once, at import)."""
    if explicit:
        return Path(explicit).expanduser()
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_endpoint() -> str:
    """The hub's address: `$HF_ENDPOINT` (a mirror, a stand-in) or huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def repo_cache_dir(cache: Path, repo_id: str) -> Path:
    """Where the cache keeps a model repository (huggingface_hub's layout: blobs/, refs/, snapshots/)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(cache: Path, model: RemoteModel) -> Path:
    return repo_cache_dir(cache, model.repo_id) / "snapshots" / model.commit


def missing_files(model: RemoteModel, snapshot: Path) -> tuple[RemoteFile, ...]:
    """The files of `model` that `snapshot` does not hold at their full size."""
    def present(f: RemoteFile) -> bool:
        path = snapshot / f.path
        return path.is_file() and path.stat().st_size == f.size  # stat follows the link to the blob

    return tuple(f for f in model.files if not present(f))


def free_bytes(path: Path) -> int:
    """Free space of the disk that holds `path` (or would: its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def format_bytes(n: float) -> str:
    """Decimal units, as the hub shows sizes: 16.6 GB, 1.8 MB."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def size_summary(model: RemoteModel) -> str:
    """What the repository holds, in one line."""
    weights = model.weight_files
    return (f"{model.repo_id} @ {model.revision} (commit {model.commit[:12]}): {len(model.files)} files, "
            f"{format_bytes(model.total_bytes)} (weights {format_bytes(sum(f.size for f in weights))} "
            f"in {len(weights)} file{'s' if len(weights) != 1 else ''})")


def check_disk(needed: int, free: int, where: Path) -> None:
    """Refuse (NotEnoughDiskError) when `free` bytes cannot hold `needed` plus the headroom."""
    want = int(needed * (1 + DISK_HEADROOM))
    if free < want:
        raise NotEnoughDiskError(
            f"not enough disk for the download: {format_bytes(needed)} still to fetch (+{DISK_HEADROOM:.0%} headroom), "
            f"{format_bytes(free)} free on the disk of {where}. Free some space, or put the cache on a larger "
            f"disk (HF_HOME=/big/disk/huggingface, the same for every process that loads the model, or --cache DIR)")


# ----------------------------------------------------------------------------- the hub

def _token_hint() -> str:
    state = "HF_TOKEN is set but was refused" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set"
    return (f"{state}. A gated or private repository needs a token of an account that may read it: accept the "
            f"licence on the repository's hub page while logged in, create a read token "
            f"(huggingface.co/settings/tokens), then `export HF_TOKEN=hf_...` and run this again")


def _hub_error(exc: BaseException, repo_id: str) -> FetchModelError | None:
    """A clear FetchModelError for a failure of the hub or the network, None for anything else."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    page = f"{hub_endpoint()}/{repo_id}"
    if isinstance(exc, GatedRepoError):
        return HubAccessError(f"{repo_id} is gated ({page}): {_token_hint()}")
    if isinstance(exc, RevisionNotFoundError):
        return FetchModelError(f"{repo_id} has no such revision: {exc}")
    if isinstance(exc, RepositoryNotFoundError):
        return HubAccessError(f"{repo_id} was not found or may not be read ({page}): check the name. {_token_hint()}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return HubAccessError(f"the hub refused {repo_id} (HTTP {status}, {page}): {_token_hint()}")
        return FetchModelError(f"the hub answered HTTP {status} for {repo_id}: {str(exc).strip()}")
    if isinstance(exc, LocalEntryNotFoundError):
        return FetchModelError(f"{repo_id} is not complete in the cache, and the hub was not asked or not reached: "
                               f"{exc}")
    # huggingface_hub lets its HTTP client's transport errors through unwrapped (httpx2 in 2.x).
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0].startswith("httpx"):
        return FetchModelError(f"cannot reach {hub_endpoint()} ({type(exc).__name__}: {exc}). Check the network "
                               "(or HF_ENDPOINT); a checkpoint already in the cache: --offline")
    return None


def remote_model(repo_id: str, revision: str = "main") -> RemoteModel:
    """The repository's files and sizes at `revision`, from the hub's metadata (no file is fetched)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise (_hub_error(exc, repo_id) or exc) from exc
    files = tuple(RemoteFile(s.rfilename, int(s.size or 0)) for s in info.siblings or ())
    return RemoteModel(repo_id, revision, info.sha, files)


def download(model: RemoteModel, cache: Path) -> Path:
    """Fetch the files the cache lacks (huggingface_hub's snapshot_download: resumes a dropped
    connection, shows progress); the snapshot directory. The revision as asked, so the cache also
    records which commit it names (refs/), which resolving the hub id offline needs."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=str(cache),
                                      endpoint=hub_endpoint()))
    except Exception as exc:
        raise (_hub_error(exc, model.repo_id) or exc) from exc


def cached_snapshot(repo_id: str, revision: str, cache: Path) -> Path:
    """The complete snapshot the cache holds for `revision`, without asking the hub."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except Exception as exc:
        raise (_hub_error(exc, repo_id) or exc) from exc


# ----------------------------------------------------------------------------- what the workbench makes of it

@dataclass
class CheckpointReport:
    """What the workbench's own loaders find in a checkpoint directory."""

    architecture: str
    """config.json's architectures[0] (model_type in brackets)."""
    coord_mode: str
    """What `model.coord_mode=auto` picks."""
    parameters: int | None
    """From the safetensors headers (None: no safetensors files)."""
    image_processor_named: str | None
    """preprocessor_config.json's image_processor_type."""
    image_processor_loaded: str | None
    """The class the workbench's loader gave (None: it failed, see problems)."""
    image_limits: tuple[int, int, int] | None
    """(factor, min_pixels, max_pixels) the loaded processor resizes with."""
    sampling_defaults: dict[str, Any]
    """generation_config.json's sampling settings away from neutral."""
    problems: list[str]

    def lines(self) -> list[str]:
        out = [f"architecture: {self.architecture} -> coordinates {self.coord_mode} "
               f"({COORDINATES.get(self.coord_mode, '?')}; what model.coord_mode=auto picks)",
               "parameters: " + (_count(self.parameters) if self.parameters is not None
                                 else "unknown (no safetensors files)")]
        named, loaded = self.image_processor_named, self.image_processor_loaded
        if loaded is not None:
            adapted = (f"; transformers 5 refuses {named}: the workbench's load_processor loads it as {loaded}"
                       if named and named != loaded and not loaded.startswith(named) else "")
            factor, lo, hi = self.image_limits or (0, 0, 0)
            out.append(f"image processor: {named or '(none named)'} -> loaded as {loaded}{adapted} "
                       f"(resizes to multiples of {factor}, {lo:,}..{hi:,} pixels)")
        if self.sampling_defaults:
            settings = ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items())
            out.append(f"generation_config.json sets {settings}. Warning: transformers merges these into every "
                       "`generate` call that leaves them unset, and vLLM applies them as request defaults, so they "
                       "change sampling. The workbench overrides them: HFPolicy generates under neutral defaults, the "
                       "vLLM server it starts gets --generation-config vllm, and ServerPolicy sends neutral values "
                       "with each request. Code of your own that calls model.generate() gets them.")
        else:
            out.append("generation_config.json: no sampling settings away from neutral")
        out += [f"PROBLEM: {p}" for p in self.problems]
        return out


def _count(n: int) -> str:
    return f"{n:,} ({n / 1e9:.2f}B)" if n >= 1e8 else f"{n:,} ({n / 1e6:.2f}M)"


def safetensors_parameters(directory: Path) -> int | None:
    """The parameter count of every *.safetensors file in `directory`, read from their headers
    (8 bytes of header length, then JSON naming each tensor's shape): exact, without loading."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                total += count
    return total


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def inspect_checkpoint(directory: Path, loaders: CheckpointLoaders) -> CheckpointReport:
    """Load `directory`'s config and processor through the workbench's loaders and report what
    they found; a loader that fails is a problem in the report, not an exception."""
    problems: list[str] = []
    config = _read_json(directory / "config.json")
    model_type = config.get("model_type", "?")
    architecture = f"{(config.get('architectures') or ['?'])[0]} (model_type {model_type})"
    try:
        coord_mode = loaders.coord_mode_for(str(directory))
    except Exception as exc:  # a config transformers cannot read
        coord_mode = "?"
        problems.append(f"config.json does not load: {type(exc).__name__}: {exc}")
    if model_type not in ("qwen2_vl", "qwen2_5_vl"):
        problems.append(f"model_type {model_type!r} is neither Qwen2-VL nor Qwen2.5-VL: the workbench's UI-TARS "
                        "prompt, parsing and coordinates assume one of them")
    named = _read_json(directory / "preprocessor_config.json").get("image_processor_type")
    loaded = limits = None
    try:
        processor = loaders.load_processor(str(directory))
        loaded = type(processor.image_processor).__name__
        limits = loaders.image_processor_limits(processor)
    except Exception as exc:
        problems.append(f"the workbench's load_processor fails on it: {type(exc).__name__}: {exc}")
    generation = SimpleNamespace(**_read_json(directory / "generation_config.json"))
    return CheckpointReport(architecture, coord_mode, safetensors_parameters(directory), named, loaded, limits,
                            loaders.sampling_defaults(generation), problems)


def where_lines(repo_id: str, cache: Path, snapshot: Path) -> list[str]:
    """Where the files are, and the two ways to name them in a config."""
    lines = [f"files: {repo_cache_dir(cache, repo_id)} (the Hugging Face cache: every process and server on this "
             "machine that uses the same cache reads this one copy)",
             f"model.path={snapshot}",
             f"or model.path={repo_id}: transformers and vLLM resolve the hub id through this cache "
             "(HF_HUB_OFFLINE=1 keeps them from asking the hub at all)"]
    if cache.resolve() != hub_cache_dir().resolve():
        lines.append(f"  for the hub id to resolve here: export HF_HUB_CACHE={cache} in every process that loads it")
    return lines


# ----------------------------------------------------------------------------- the command

@dataclass
class FetchResult:
    snapshot: Path
    downloaded: bool
    """False: everything was already in the cache."""
    report: CheckpointReport


def fetch_model(repo_id: str, loaders: CheckpointLoaders, *, revision: str = "main", cache: str | Path | None = None,
                offline: bool = False, say: Callable[[str], None] = print) -> FetchResult:
    """Size first, then the disk check, then the download of what is missing, then the report.
    `offline`: the hub is not asked; the cache must hold the checkpoint complete."""
    cache_dir = hub_cache_dir(cache)
    downloaded = False
    if offline:
        snapshot = cached_snapshot(repo_id, revision, cache_dir)
        say(f"already complete: {snapshot} (offline: the hub was not asked)")
    else:
        model = remote_model(repo_id, revision)
        say(size_summary(model))
        missing = missing_files(model, snapshot_dir(cache_dir, model))
        needed = sum(f.size for f in missing)
        free = free_bytes(cache_dir)
        say(f"cache: {cache_dir} ({format_bytes(free)} free; {format_bytes(needed)} to download)")
        if missing:
            check_disk(needed, free, cache_dir)
            snapshot = download(model, cache_dir)
            downloaded = True
        else:
            snapshot = snapshot_dir(cache_dir, model)
            say(f"already complete: {snapshot}")
    for line in where_lines(repo_id, cache_dir, snapshot):
        say(line)
    report = inspect_checkpoint(snapshot, loaders)
    for line in report.lines():
        say(line)
    return FetchResult(snapshot, downloaded, report)
