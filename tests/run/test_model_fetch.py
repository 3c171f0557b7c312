"""`fetch-model` against a stand-in of the Hugging Face hub: a local HTTP server speaking the part of
the hub's API huggingface_hub uses to list and download a model (`/api/models/{repo}/revision/{rev}`,
`/api/models/{repo}/tree/{rev}`, HEAD and ranged GET of `/{repo}/resolve/{rev}/{file}`), serving the
tiny UI-TARS-architecture models, reached through HF_ENDPOINT.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from arpo_lib import cli
from arpo_lib.agent.hf_policy import checkpoint_sampling_defaults
from arpo_lib.agent.prompt import coord_mode_for, image_processor_limits, load_processor
from arpo_lib.run import model_fetch

REPO = Path(__file__).resolve().parents[2]
LOADERS = model_fetch.CheckpointLoaders(load_processor, coord_mode_for, image_processor_limits,
                                        checkpoint_sampling_defaults)
QWEN25 = "test-org/tiny-uitars-qwen25vl"
QWEN2 = "test-org/tiny-uitars-qwen2vl"
WEIGHTS = "model.safetensors"


@dataclass
class HubRepo:
    commit: str
    files: dict[str, bytes]


@dataclass
class StandInHub:
    """The hub's state and what it saw. `drop_after[file] = n`: the first GET of that file sends
    n bytes of it and closes the connection. `refuse = (status, headers)`: every request gets it."""

    repos: dict[str, HubRepo]
    url: str = ""
    events: list[tuple] = field(default_factory=list)
    """("request", method, path, headers with lower-case names) from the server, ("say", line) from the
    command, in order."""
    drop_after: dict[str, int] = field(default_factory=dict)
    refuse: tuple[int, dict[str, str]] | None = None

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple]:
        return [e for e in self.events if e[0] == "request" and (method is None or e[1] == method) and contains in e[2]]

    def said(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "say"]


class HubHandler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _json(self, payload, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, body: bool) -> None:
        hub: StandInHub = self.server.hub  # type: ignore[attr-defined]
        path = unquote(urlsplit(self.path).path)
        hub.events.append(("request", self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if hub.refuse is not None:
            status, headers = hub.refuse
            return self._json({"error": "refused"}, status, headers)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path):
            repo_id, kind, revision = m.groups()
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if kind == "revision":
                siblings = [{"rfilename": name, "size": len(data), "blobId": _etag(data),
                             **({"lfs": {"sha256": _etag(data), "size": len(data), "pointerSize": 134}}
                                if name.endswith(".safetensors") else {})}
                            for name, data in repo.files.items()]
                return self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                   "siblings": siblings})
            return self._json([{"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
                               for name, data in repo.files.items()])
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo_id, revision, name = m.groups()
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if name not in repo.files:
                return self._json({"error": "entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
            return self._file(hub, repo, name, body)
        self._json({"error": f"no route {path}"}, 404)

    def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
        hub: StandInHub = self.server.hub  # type: ignore[attr-defined]
        repo = hub.repos.get(repo_id)
        if repo is None:
            self._json({"error": "repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
        elif revision not in ("main", repo.commit):
            self._json({"error": "revision not found"}, 404, {"X-Error-Code": "RevisionNotFound"})
        else:
            return repo
        return None

    def _file(self, hub: StandInHub, repo: HubRepo, name: str, body: bool) -> None:
        data = repo.files[name]
        start = 0
        if body and (wanted := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
            start = int(wanted.group(1))
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{_etag(data)}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = hub.drop_after.pop(name, None) if not start else None
        if cut is not None:  # the connection drops mid-file
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data[start:])


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _repo_from(directory: Path, **replace: bytes | None) -> HubRepo:
    files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")}
    for name, data in replace.items():
        name = name.replace("__", ".")
        if data is None:
            files.pop(name, None)
        else:
            files[name] = data
    commit = hashlib.sha1(b"".join(hashlib.sha1(d).digest() for d in files.values())).hexdigest()
    return HubRepo(commit, files)


def _like_qwen25vl_instruct(tiny_qwen25vl: Path) -> HubRepo:
    """The tiny Qwen2.5-VL model with Qwen2.5-VL-7B-Instruct's kind of processor files (no
    processor_config.json, the image processor named Qwen2_5_VLImageProcessor, limits as
    size {min_pixels, max_pixels}) and its generation_config.json sampling settings."""
    pre = json.loads((tiny_qwen25vl / "preprocessor_config.json").read_text())
    pre.update(image_processor_type="Qwen2_5_VLImageProcessor", processor_class="Qwen2_5_VLProcessor",
               size={"min_pixels": 3136, "max_pixels": 100352})
    gen = json.loads((tiny_qwen25vl / "generation_config.json").read_text())
    gen.update(do_sample=True, repetition_penalty=1.05, top_k=1, top_p=0.001, temperature=0.1)
    return _repo_from(tiny_qwen25vl, processor_config__json=None,
                      preprocessor_config__json=json.dumps(pre).encode(),
                      generation_config__json=json.dumps(gen).encode())


@pytest.fixture
def hub(tiny_qwen25vl, tiny_qwen2vl, tmp_path, monkeypatch):
    """The stand-in hub serving both tiny models, with this test's own Hugging Face home."""
    state = StandInHub({QWEN25: _like_qwen25vl_instruct(tiny_qwen25vl), QWEN2: _repo_from(tiny_qwen2vl)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    server.daemon_threads = True
    server.hub = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # load_processor's corrected configs
    yield state
    server.shutdown()
    server.server_close()


def _fetch(hub: StandInHub, repo_id: str, **kwargs) -> model_fetch.FetchResult:
    return model_fetch.fetch_model(repo_id, LOADERS, say=lambda line: hub.events.append(("say", line)), **kwargs)


def _cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"


# ----------------------------------------------------------------------------- the download

def test_the_size_is_printed_before_any_file_is_downloaded(hub, tmp_path):
    result = _fetch(hub, QWEN25)
    repo = hub.repos[QWEN25]
    total = sum(len(d) for d in repo.files.values())
    size_at = next(i for i, e in enumerate(hub.events) if e[0] == "say" and model_fetch.format_bytes(total) in e[1])
    first_get = next(i for i, e in enumerate(hub.events) if e[0] == "request" and e[1] == "GET" and "/resolve/" in e[2])
    assert size_at < first_get
    assert f"{len(repo.files)} files" in hub.said()[0] and repo.commit[:12] in hub.said()[0]
    assert any(line.startswith(f"cache: {_cache(tmp_path)}") and "free" in line for line in hub.said())
    assert result.downloaded and result.snapshot == _cache(tmp_path) / "models--test-org--tiny-uitars-qwen25vl" / \
        "snapshots" / repo.commit
    for name, data in repo.files.items():
        assert (result.snapshot / name).read_bytes() == data


def test_a_dropped_connection_resumes_with_a_range_request_and_identical_bytes(hub, monkeypatch):
    """huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MB) and resumes
    after the last whole one; the tiny weights (1.8 MB) need smaller chunks to show it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    hub.drop_after[WEIGHTS] = 100_000
    result = _fetch(hub, QWEN25)
    gets = [e for e in hub.requests("GET", "/resolve/") if e[2].endswith(f"/{WEIGHTS}")]
    assert len(gets) == 2, gets
    assert "range" not in gets[0][3] and gets[1][3]["range"] == f"bytes={1 << 16}-"
    assert (result.snapshot / WEIGHTS).read_bytes() == hub.repos[QWEN25].files[WEIGHTS]
    assert not list(result.snapshot.parent.parent.glob("blobs/*.incomplete"))


def test_hf_token_is_sent_as_authorization(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
    _fetch(hub, QWEN2)
    seen = hub.requests()
    assert seen and all(e[3].get("authorization") == "Bearer hf_standin_token" for e in seen)


@pytest.mark.parametrize("status, headers", [(401, {}), (403, {"X-Error-Code": "GatedRepo"})], ids=["401", "gated"])
def test_a_refused_repository_says_to_set_hf_token_and_exits_2(hub, capsys, status, headers):
    hub.refuse = (status, headers)
    assert cli.main(["fetch-model", QWEN25]) == 2
    err = capsys.readouterr().err
    assert "HF_TOKEN is not set" in err and "accept the licence" in err and f"{hub.url}/{QWEN25}" in err
    assert "Traceback" not in err
    assert not hub.requests("GET", "/resolve/")


def test_not_enough_disk_refuses_before_any_download(hub, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(model_fetch, "free_bytes", lambda path: 1000)
    assert cli.main(["fetch-model", QWEN25]) == 2
    out, err = capsys.readouterr()
    assert "not enough disk" in err and "1.0 kB free" in err
    assert "files" in out  # the size came first
    assert not hub.requests("GET", "/resolve/") and not hub.requests("HEAD", "/resolve/")
    assert not (_cache(tmp_path) / "models--test-org--tiny-uitars-qwen25vl").exists()


# ----------------------------------------------------------------------------- the cache

def test_a_second_call_downloads_nothing_and_the_cache_holds_one_copy(hub, tmp_path):
    first = _fetch(hub, QWEN25)
    before = len(hub.events)
    # another process (a second rank, a server) with the same HF_HOME, through the command line
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "arpo_lib", "fetch-model", QWEN25], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"already complete: {first.snapshot}" in done.stdout
    assert not [e for e in hub.events[before:] if e[0] == "request" and e[1] == "GET" and "/resolve/" in e[2]]
    repo_dir = _cache(tmp_path) / "models--test-org--tiny-uitars-qwen25vl"
    assert len(list((repo_dir / "blobs").iterdir())) == len(hub.repos[QWEN25].files)
    assert [p.name for p in (repo_dir / "snapshots").iterdir()] == [hub.repos[QWEN25].commit]

    before = len(hub.events)
    offline = _fetch(hub, QWEN25, offline=True)
    assert offline.snapshot == first.snapshot and not offline.downloaded
    assert not [e for e in hub.events[before:] if e[0] == "request"]
    assert any(line.startswith("already complete") for line in hub.said())

    # model.path=<hub id> resolves through this cache, without the hub
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(QWEN25, cache_dir=str(_cache(tmp_path)), local_files_only=True)
    assert config.model_type == "qwen2_5_vl"


def test_offline_without_a_cached_copy_is_a_clear_error(hub, capsys):
    assert cli.main(["fetch-model", QWEN2, "--offline"]) == 2
    err = capsys.readouterr().err
    assert "not complete in the cache" in err and "Traceback" not in err
    assert not hub.requests()


def test_an_unreachable_hub_is_a_clear_error(hub, capsys, monkeypatch):
    from arpo_lib.serving.launch import free_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert cli.main(["fetch-model", QWEN2]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and "--offline" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- the report

def test_the_report_names_the_architecture_processor_and_sampling_settings(hub):
    from safetensors import safe_open

    result = _fetch(hub, QWEN25)
    report = result.report
    assert report.architecture.startswith("Qwen2_5_VLForConditionalGeneration") and report.coord_mode == "qwen25vl"
    assert report.image_processor_named == "Qwen2_5_VLImageProcessor"
    assert report.image_processor_loaded.startswith("Qwen2VLImageProcessor")
    assert report.image_limits == (28, 3136, 100352)
    assert report.sampling_defaults == {"temperature": 0.1, "top_k": 1, "top_p": 0.001, "repetition_penalty": 1.05,
                                        "do_sample": True}
    with safe_open(str(result.snapshot / WEIGHTS), "pt") as f:
        expected = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert report.parameters == expected
    assert not report.problems
    said = "\n".join(hub.said())
    assert "transformers 5 refuses Qwen2_5_VLImageProcessor" in said and "absolute pixels" in said
    assert "Warning: transformers merges these" in said and "--generation-config vllm" in said
    assert f"model.path={result.snapshot}" in said and f"model.path={QWEN25}" in said


def test_the_qwen2vl_report_gives_relative_coordinates_and_no_sampling_warning(hub):
    report = _fetch(hub, QWEN2).report
    assert report.architecture.startswith("Qwen2VLForConditionalGeneration") and report.coord_mode == "qwen2vl"
    assert report.image_processor_named == "Qwen2VLImageProcessor" and not report.problems
    said = "\n".join(hub.said())
    assert "relative, 0..1000" in said and "no sampling settings away from neutral" in said
    assert "refuses" not in said


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ----------------------------------------------------------------------------- the pure parts

def test_format_bytes_uses_the_hubs_decimal_units():
    assert model_fetch.format_bytes(999) == "999 B"
    assert model_fetch.format_bytes(1_790_744) == "1.8 MB"
    assert model_fetch.format_bytes(16_580_000_000) == "16.6 GB"


def test_check_disk_keeps_headroom(tmp_path):
    model_fetch.check_disk(1000, 1020, tmp_path)
    with pytest.raises(model_fetch.NotEnoughDiskError, match="HF_HOME"):
        model_fetch.check_disk(1000, 1019, tmp_path)


def test_missing_files_compares_sizes(tmp_path):
    model = model_fetch.RemoteModel("a/b", "main", "c" * 40, (model_fetch.RemoteFile("x.json", 3),
                                                             model_fetch.RemoteFile("w.safetensors", 5)))
    (tmp_path / "x.json").write_bytes(b"abc")
    (tmp_path / "w.safetensors").write_bytes(b"ab")  # cut short
    assert model_fetch.missing_files(model, tmp_path) == (model.files[1],)
    assert model.weight_files == (model.files[1],) and model.total_bytes == 8


def test_the_cache_follows_huggingface_hubs_variables(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_fetch.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert model_fetch.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_fetch.hub_cache_dir() == tmp_path / "hub"
    assert model_fetch.hub_cache_dir(tmp_path / "given") == tmp_path / "given"
