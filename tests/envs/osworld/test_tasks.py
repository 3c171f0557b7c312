"""OSWorld task data: fetch (tarball, directory, HTTP), validation, the cache, task sets, the CLI.

The fixture `test_data/osworld/evaluation_examples/` is our own small tree in the fork's layout
(8 tasks: chrome 3, libreoffice_calc 2, os 3; meta lists test_all.json, test_small.json and a
7-task stand-in for ARPO's 128 list). Tarballs are built from it on the fly.
"""
from __future__ import annotations

import contextlib
import http.server
import io
import json
import shutil
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from arpo_lib import cli
from arpo_lib.run import fetch as fetching
from arpo_lib.envs.osworld import tasks as ot

FIXTURE = Path(__file__).resolve().parents[3] / "test_data" / "osworld"
EE = FIXTURE / "evaluation_examples"
OS_A, OS_B, OS_INFEASIBLE = ("9edf2168-773d-465e-8f86-3491baf41e09", "86a7b1b6-14dc-4370-a006-d732abaf4605",
                             "36d5c08d-ec36-4998-8b59-af0ffa7e2df6")
CHROME_D, CHROME_E, CHROME_TABS = ("73722ca8-ff78-42a6-a8a4-c3f3d3dd4537", "7bfc582c-67e8-4b75-8240-8cec8140b81c",
                                   "370155d7-68be-49d6-9303-6ba71b75fb98")
CALC_G, CALC_H = "1344f0c9-1ffe-4e71-8476-1808e329c734", "157f2ad6-e8a3-4397-801d-781b2810a85d"
FIXTURE_EXPECT = ot.Expectations(
    lists={ot.TRAIN_LIST: {"chrome": 3, "libreoffice_calc": 1, "os": 3}, ot.TEST_ALL_LIST: 8},
    set_sizes={"train128": 7, "test_all": 8, "subset32": 6, "smoke4": 4, "chrome10": 3},
)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache root; none touches ~/.cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv(ot.ENV_VAR, str(root))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setattr(fetching, "DOWNLOAD_BACKOFF_S", 0.0)
    return root


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, **info) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    for key, value in info.items():
        setattr(member, key, value)
    tar.addfile(member, io.BytesIO(data))


def make_tarball(path: Path, tree: Path = EE, top: str = "OSWorld-fixture", extra=(), pax_commit: str | None = None,
                 mode: str = "w:gz") -> Path:
    """A GitHub-style archive: `<top>/evaluation_examples/...` plus files outside it."""
    pax = {"comment": pax_commit} if pax_commit else {}
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT, pax_headers=pax) as tar:
        prefix = f"{top}/" if top else ""
        _add_bytes(tar, f"{prefix}README.md", b"not task data\n")
        _add_bytes(tar, f"{prefix}desktop_env/evaluators/metrics.py", b"# outside evaluation_examples\n")
        tar.add(tree, arcname=f"{prefix}evaluation_examples")
        for member, data in extra:
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return path


def tree_copy(tmp_path: Path) -> Path:
    """A writable copy of the fixture checkout (holds evaluation_examples/)."""
    out = tmp_path / "checkout"
    shutil.copytree(FIXTURE / "evaluation_examples", out / "evaluation_examples")
    return out


def fetch(source, **kw) -> Path:
    kw.setdefault("expect", FIXTURE_EXPECT)
    kw.setdefault("progress", False)
    return ot.fetch_tasks(source, **kw)


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith((".staging", ".old"))) if cache.exists() else []


@contextlib.contextmanager
def serve(files: dict[str, bytes], fail_first: int = 0, short_body: bool = False):
    """A local HTTP server in a thread: `files` by path; the first `fail_first` requests get 503;
    with `short_body`, the declared Content-Length is longer than what is sent."""
    state = {"fails": fail_first, "hits": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            state["hits"] += 1
            if state["fails"] > 0:
                state["fails"] -= 1
                self.send_error(503)
                return
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) + (1000 if short_body else 0)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", state
    finally:
        server.shutdown()
        server.server_close()


# ---- the fixture and the schema ---------------------------------------------------------------

def test_fixture_tasks_are_valid_osworld_tasks():
    files = sorted((EE / "examples").glob("*/*.json"))
    assert len(files) == 8
    for path in files:
        task = json.loads(path.read_text())
        assert ot.validate_task(task) == [], path
        assert task["id"] == path.stem


def test_validate_task_names_each_problem():
    good = json.loads((EE / "examples" / "chrome" / f"{CHROME_TABS}.json").read_text())
    assert ot.validate_task(good) == []
    assert ot.validate_task([]) == ["a task must be a JSON object, got list"]
    assert ot.validate_task({**good, "evaluator": {"func": "infeasible"}}) == []
    bad = {**good, "instruction": " ", "config": [{"parameters": {}}], "related_apps": "chrome",
           "proxy": "no", "evaluator": {**good["evaluator"], "expected": good["evaluator"]["expected"][:1]}}
    problems = ot.validate_task(bad)
    assert "instruction must be a non-empty string" in problems
    assert "config[0].type must be a non-empty string" in problems
    assert "related_apps must be a list of strings" in problems
    assert "proxy must be a bool" in problems
    assert "evaluator.expected must be a list of 2 items, one per func" in problems
    no_result = {k: v for k, v in good.items() if k != "evaluator"} | {"evaluator": {"func": "exact_match"}}
    assert ot.validate_task(no_result) == ["evaluator.result must be an object (func 'exact_match')"]
    assert ot.validate_task({k: v for k, v in good.items() if k != "evaluator"}) == ["evaluator is missing"]


def test_proportional_quota_on_arpo_counts_is_the_documented_subset32():
    counts = ot.PINNED_EXPECTATIONS.lists[ot.TRAIN_LIST]
    quota = ot.proportional_quota(counts, 32)
    # 32/128 = 1/4 of each domain, floors sum to 27; the 5 largest remainders (.75) get one more.
    assert quota == {"chrome": 4, "gimp": 5, "libreoffice_calc": 3, "libreoffice_impress": 3,
                     "libreoffice_writer": 3, "multi_apps": 3, "os": 3, "thunderbird": 2, "vlc": 1, "vs_code": 5}
    assert sum(quota.values()) == 32
    assert ot.proportional_quota({"a": 2, "b": 1}, 10) == {"a": 2, "b": 1}


def test_stable_subset_is_reproducible_and_keeps_order():
    by_domain = {"a": [f"a{i}" for i in range(10)], "b": [f"b{i}" for i in range(10)]}
    first = ot.stable_subset(by_domain, 6, "salt")
    assert first == ot.stable_subset(by_domain, 6, "salt")
    assert {d: len(v) for d, v in first.items()} == {"a": 3, "b": 3}
    for domain, ids in first.items():
        assert ids == [t for t in by_domain[domain] if t in ids]
    assert first != ot.stable_subset(by_domain, 6, "other salt")


# ---- fetching ---------------------------------------------------------------------------------

def test_fetch_from_file_url_of_a_tarball(tmp_path, cache):
    archive = make_tarball(tmp_path / "osworld.tar.gz")
    root = fetch(archive.as_uri())
    assert root == ot.tasks_root() and root.parent == cache and root.name.startswith("unknown-")
    assert ot.is_fetched()
    manifest = ot.read_manifest()
    assert manifest["domains"] == {"chrome": 3, "libreoffice_calc": 2, "os": 3}
    assert manifest["task_count"] == 8 and manifest["file_count"] == 11
    assert manifest["commit"] is None and manifest["warnings"] == []
    assert manifest["archive_sha256"] == fetching.sha256_file(archive)
    assert manifest["meta_lists"][ot.TRAIN_LIST]["total"] == 7
    assert not (root / "README.md").exists() and not (root / "desktop_env").exists()
    assert sorted(p.name for p in root.iterdir()) == ["evaluation_examples", "manifest.json"]
    assert ot.verify_cache() == []
    assert leftovers(cache) == []


def test_fetch_from_a_local_checkout_and_its_examples_dir(tmp_path):
    root = fetch(FIXTURE)
    assert ot.cached_task_ids() == sorted([OS_A, OS_B, OS_INFEASIBLE, CHROME_D, CHROME_E, CHROME_TABS, CALC_G, CALC_H])
    assert ot.read_manifest()["source"] == str(EE)
    other = fetch(EE, dest=tmp_path / "elsewhere")
    assert ot.read_manifest(other)["tree_sha256"] == ot.read_manifest(root)["tree_sha256"]


def test_fetch_over_http_with_retries(tmp_path, cache):
    data = make_tarball(tmp_path / "a.tar.gz").read_bytes()
    with serve({"/osworld.tar.gz": data}, fail_first=2) as (url, state):
        root = fetch(f"{url}/osworld.tar.gz", progress=True)
        assert state["hits"] == 3  # two 503s retried
    manifest = ot.read_manifest(root)
    assert manifest["source"].endswith("/osworld.tar.gz")
    assert manifest["archive_sha256"] == fetching.sha256_file(tmp_path / "a.tar.gz")
    assert ot.verify_cache() == []
    assert not (root / "archive.tar").exists() and leftovers(cache) == []


def test_http_404_fails_at_once_naming_the_url(cache):
    with serve({}) as (url, state):
        with pytest.raises(ot.TaskDataError, match=r"could not download .*/missing.tar.gz: HTTP 404"):
            fetch(f"{url}/missing.tar.gz")
        assert state["hits"] == 1
    assert not ot.is_fetched() and leftovers(cache) == []


def test_truncated_download_is_retried_then_reported(tmp_path, monkeypatch, cache):
    monkeypatch.setattr(fetching, "DOWNLOAD_ATTEMPTS", 2)
    data = make_tarball(tmp_path / "a.tar.gz").read_bytes()
    with serve({"/a.tar.gz": data}, short_body=True) as (url, state):
        with pytest.raises(ot.TaskDataError, match="after 2 attempts: IncompleteRead"):
            fetch(f"{url}/a.tar.gz")
        assert state["hits"] == 2
    assert not ot.is_fetched() and leftovers(cache) == []


def test_unreachable_host_gives_an_actionable_error(monkeypatch):
    monkeypatch.setattr(fetching, "DOWNLOAD_ATTEMPTS", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ot.TaskDataError) as info:
        fetch(f"http://127.0.0.1:{port}/x.tar.gz")
    message = str(info.value)
    assert "after 2 attempts" in message and "--source" in message and ot.OSWORLD_TASKS_COMMIT in message


def test_refetch_is_a_no_op_and_force_replaces(tmp_path):
    root = fetch(FIXTURE)
    before = ot.read_manifest()
    assert fetch(tmp_path / "does-not-exist", dest=root) == root  # complete cache: the source is not even read
    assert ot.read_manifest() == before
    archive = make_tarball(tmp_path / "osworld.tar.gz")
    fetch(archive, force=True)
    after = ot.read_manifest()
    assert after["source"] == str(archive) and after["tree_sha256"] == before["tree_sha256"]


def test_an_incomplete_cache_dir_is_replaced(cache):
    ot.tasks_root().mkdir(parents=True)
    (ot.tasks_root() / "junk.txt").write_text("half a fetch")
    assert not ot.is_fetched()
    fetch(FIXTURE)
    assert ot.is_fetched() and not (ot.tasks_root() / "junk.txt").exists()


def test_pinned_commit_is_recognised_and_its_counts_checked(tmp_path):
    sha = ot.OSWORLD_TASKS_COMMIT
    archive = make_tarball(tmp_path / "pinned.tar.gz", top=f"OSWorld-{sha}")
    with pytest.raises(ot.TaskDataError, match="per-domain counts") as info:
        fetch(archive, expect=None)  # the fixture is not ARPO's 128 tasks
    assert "369" in str(info.value)
    assert not ot.is_fetched()
    fetch(archive)  # with the fixture's own expectations
    assert ot.read_manifest()["commit"] == sha
    assert ot.read_manifest()["expectations"]["set_sizes"]["smoke4"] == 4


def test_commit_from_git_archive_pax_header(tmp_path):
    archive = make_tarball(tmp_path / "a.tar", top="", pax_commit=ot.OSWORLD_TASKS_COMMIT, mode="w")
    fetch(archive)
    assert ot.read_manifest()["commit"] == ot.OSWORLD_TASKS_COMMIT


def test_another_commit_is_not_cached_under_the_pinned_name(tmp_path):
    archive = make_tarball(tmp_path / "a.tar.gz", top="OSWorld-" + "0" * 40)
    root = fetch(archive)
    assert root.name == "0" * 12 and root != ot.pinned_root() and not ot.pinned_root().exists()
    assert ot.tasks_root() == root and ot.read_manifest()["commit"] == "0" * 40
    assert ot.provenance(ot.read_manifest()) == "commit 000000000000"
    other = fetch(archive, dest=tmp_path / "other-commit")
    assert ot.read_manifest(other)["commit"] == "0" * 40


def test_data_of_unknown_origin_gets_its_own_slot_never_the_pinned_one(tmp_path):
    root = fetch(tree_copy(tmp_path))  # a checkout: no commit anywhere
    manifest = ot.read_manifest(root)
    assert manifest["commit"] is None and root.name == f"unknown-{manifest['tree_sha256'][:12]}"
    assert not ot.pinned_root().exists() and ot.tasks_root() == root
    assert ot.provenance(manifest).startswith("unknown commit (from ")


def test_files_whose_id_differs_from_their_name_are_accepted_by_file_name(tmp_path):
    """The fork has 15 thunderbird files carrying other tasks' ids; ARPO's loader uses the file name."""
    checkout = tree_copy(tmp_path)
    path = checkout / "evaluation_examples" / "examples" / "os" / f"{OS_B}.json"
    path.write_text(path.read_text().replace(OS_B, OS_A))
    root = fetch(checkout)
    manifest = ot.read_manifest(root)
    assert manifest["id_mismatches"] == {OS_B: OS_A} and OS_B in manifest["tasks"]
    assert "1 task files carry an `id` other than their file name" in manifest["warnings"][0]
    task = ot.load_task(OS_B)
    assert task["id"] == OS_B and task["original_id"] == OS_A
    assert ot.load_task(OS_A)["id"] == OS_A and "original_id" not in ot.load_task(OS_A)


def test_expected_counts_mismatch_is_an_error():
    expect = ot.Expectations(lists={ot.TRAIN_LIST: {"chrome": 3, "os": 4}})
    with pytest.raises(ot.TaskDataError, match=r"per-domain counts .* differ"):
        fetch(FIXTURE, expect=expect)
    with pytest.raises(ot.TaskDataError, match="task set chrome10 resolves to 3 tasks, expected 10"):
        fetch(FIXTURE, expect=ot.Expectations(set_sizes={"chrome10": 10}))
    assert not ot.is_fetched()


# ---- failures leave the old cache (or none) ---------------------------------------------------

def _missing_listed_id(ee: Path) -> str:
    (ee / "examples" / "os" / f"{OS_A}.json").unlink()
    return f"os/{OS_A} is listed but examples/os/{OS_A}.json does not exist"


def _invalid_json(ee: Path) -> str:
    (ee / "examples" / "chrome" / f"{CHROME_D}.json").write_text('{"id": ')
    return f"examples/chrome/{CHROME_D}.json: invalid JSON"


def _schema_error(ee: Path) -> str:
    path = ee / "examples" / "os" / f"{OS_B}.json"
    task = json.loads(path.read_text())
    del task["evaluator"]
    path.write_text(json.dumps(task))
    return f"examples/os/{OS_B}.json: evaluator is missing"


def _wrong_domain(ee: Path) -> str:
    meta = json.loads((ee / ot.TEST_ALL_LIST).read_text())
    meta["chrome"].append(OS_A)
    (ee / ot.TEST_ALL_LIST).write_text(json.dumps(meta))
    return "it is in examples/os/"


def _missing_required_list(ee: Path) -> str:
    (ee / ot.TRAIN_LIST).unlink()
    return f"{ot.TRAIN_LIST} is missing"


def _train_not_in_test_all(ee: Path) -> str:
    meta = json.loads((ee / ot.TEST_ALL_LIST).read_text())
    meta["os"].remove(OS_A)
    (ee / ot.TEST_ALL_LIST).write_text(json.dumps(meta))
    return f"are not in {ot.TEST_ALL_LIST}"


@pytest.mark.parametrize("damage", [_missing_listed_id, _invalid_json, _schema_error, _wrong_domain,
                                    _missing_required_list, _train_not_in_test_all])
def test_invalid_data_is_refused_and_the_old_cache_kept(tmp_path, cache, damage):
    checkout = tree_copy(tmp_path)
    expected = damage(checkout / "evaluation_examples")
    archive = make_tarball(tmp_path / "bad.tar.gz", tree=checkout / "evaluation_examples")
    for source in (checkout, archive):
        with pytest.raises(ot.TaskDataError, match="not valid") as info:
            fetch(source, expect=ot.Expectations())
        assert expected in str(info.value)
        assert not ot.is_fetched() and leftovers(cache) == []
    fetch(FIXTURE)
    before = ot.read_manifest()
    with pytest.raises(ot.TaskDataError):
        fetch(archive, force=True, expect=ot.Expectations())
    assert ot.read_manifest() == before and ot.verify_cache() == [] and leftovers(cache) == []


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", data: bytes = b"x") -> tuple:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = linkname
    member.size = len(data) if kind == tarfile.REGTYPE else 0
    return member, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize("extra, message", [
    (_member("../evil.txt"), "leaves the archive"),
    (_member("OSWorld-fixture/evaluation_examples/../../evil.txt"), "leaves the archive"),
    (_member("/tmp/arpo-evil.txt"), "absolute"),
    (_member("OSWorld-fixture/evaluation_examples/examples/os/evil.json", tarfile.SYMTYPE, "../../../../evil.txt"),
     "points outside"),
    (_member("OSWorld-fixture/evaluation_examples/evil.json", tarfile.SYMTYPE, "/etc/passwd"), "absolute"),
    (_member("OSWorld-fixture/evaluation_examples/evil.json", tarfile.LNKTYPE, "OSWorld-fixture/README.md"),
     "points outside"),
    (_member("OSWorld-fixture/evaluation_examples/dev", tarfile.CHRTYPE), "device or fifo"),
])
def test_unsafe_archive_members_refuse_the_archive(tmp_path, cache, extra, message):
    archive = make_tarball(tmp_path / "evil.tar.gz", extra=[extra])
    fetch(FIXTURE)
    before = ot.read_manifest()
    with pytest.raises(ot.TaskDataError, match=message):
        fetch(archive, force=True)
    assert ot.read_manifest() == before and ot.verify_cache() == [] and leftovers(cache) == []
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/arpo-evil.txt").exists()


def test_links_inside_evaluation_examples_become_copies(tmp_path):
    extra = [_member("OSWorld-fixture/evaluation_examples/test_small_alias.json", tarfile.SYMTYPE, "test_small.json"),
             _member("OSWorld-fixture/evaluation_examples/settings/small.json", tarfile.SYMTYPE,
                     "../test_small_alias.json"),
             _member("OSWorld-fixture/evaluation_examples/settings/hard.json", tarfile.LNKTYPE,
                     "OSWorld-fixture/evaluation_examples/test_small.json")]
    root = fetch(make_tarball(tmp_path / "links.tar.gz", extra=extra))
    ee = ot.examples_dir(root)
    for rel in ("test_small_alias.json", "settings/small.json", "settings/hard.json"):
        assert not (ee / rel).is_symlink() and (ee / rel).read_bytes() == (EE / "test_small.json").read_bytes()


def test_checkout_with_a_link_leaving_it_is_refused(tmp_path):
    checkout = tree_copy(tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    (checkout / "evaluation_examples" / "secret.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(ot.TaskDataError, match="links outside"):
        fetch(checkout)


@pytest.mark.parametrize("corrupt", ["truncated", "garbage", "no evaluation_examples"])
def test_corrupt_archives_are_refused(tmp_path, cache, corrupt):
    good = make_tarball(tmp_path / "good.tar.gz").read_bytes()
    bad = tmp_path / "bad.tar.gz"
    if corrupt == "truncated":
        bad.write_bytes(good[: len(good) // 2])
    elif corrupt == "garbage":
        bad.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 10)
    else:
        make_tarball(bad, tree=EE / "examples", top="OSWorld-fixture/other")
    with pytest.raises(ot.TaskDataError, match="tar archive|no evaluation_examples"):
        fetch(bad)
    assert not ot.is_fetched() and leftovers(cache) == []


def test_bad_sources_are_named():
    with pytest.raises(ot.TaskDataError, match="neither an http"):
        fetch("/no/such/osworld.tar.gz")
    with pytest.raises(ot.TaskDataError, match="without evaluation_examples"):
        fetch(EE / "examples")


def test_other_meta_lists_only_warn(tmp_path):
    checkout = tree_copy(tmp_path)
    (checkout / "evaluation_examples" / "test_custom.json").write_text(json.dumps({"os": ["nope"]}))
    (checkout / "evaluation_examples" / "results.json").write_text(json.dumps({"score": 1}))
    fetch(checkout)
    warnings = ot.read_manifest()["warnings"]
    assert any("test_custom.json: os/nope is listed" in w for w in warnings)
    assert any("results.json is not a meta list" in w for w in warnings)


def test_verify_cache_detects_changes():
    root = fetch(FIXTURE)
    assert ot.verify_cache() == []
    ee = ot.examples_dir(root)
    task = ee / "examples" / "os" / f"{OS_A}.json"
    task.write_text(task.read_text().replace("reports", "records"))
    (ee / "examples" / "os" / f"{OS_B}.json").unlink()
    (ee / "extra.json").write_text("{}")
    problems = ot.verify_cache()
    assert any(p.startswith(f"evaluation_examples/examples/os/{OS_A}.json: modified") for p in problems)
    assert f"evaluation_examples/examples/os/{OS_B}.json: missing" in problems
    assert "evaluation_examples/extra.json: not in the manifest" in problems
    assert ot.verify_cache(root.parent / "nothing")[0].startswith("no usable manifest")


# ---- reading tasks and task sets --------------------------------------------------------------

def test_reading_before_fetching_says_how_to_fetch():
    assert ot.cached_task_ids() == [] and not ot.is_fetched()
    for call in (lambda: ot.load_task(OS_A), lambda: ot.task_set("train128"), lambda: ot.task_domain(OS_A)):
        with pytest.raises(FileNotFoundError, match="osworld-tasks fetch"):
            call()


def test_cached_task_ids_never_raises(cache):
    ot.tasks_root().mkdir(parents=True)
    for text in ("{not json", "[]", json.dumps({"format": 1}), json.dumps({"format": 1, "tasks": 3})):
        (ot.tasks_root() / ot.MANIFEST).write_text(text)
        assert ot.cached_task_ids() == [] and not ot.is_fetched()
        with pytest.raises(FileNotFoundError, match="fetch --force"):
            ot.task_set("train128")


def test_load_task_and_domain():
    fetch(FIXTURE)
    task = ot.load_task(OS_A)
    assert task["id"] == OS_A and task["evaluator"]["func"] == "exact_match"
    assert ot.load_task(f"osworld/{CALC_H}")["possibility_of_env_change"] == "low"
    assert ot.task_domain(f"osworld/{CALC_G}") == "libreoffice_calc"
    with pytest.raises(ot.UnknownTaskError, match=f"Close: {OS_A}") as info:
        ot.load_task(OS_A[:-1] + "0")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="unknown OSWorld task id 'nope'"):
        ot.load_task("nope")
    (ot.examples_dir() / "examples" / "os" / f"{OS_A}.json").unlink()
    with pytest.raises(FileNotFoundError, match="damaged"):
        ot.load_task(OS_A)


def test_task_sets_on_the_fixture():
    fetch(FIXTURE)
    train = [f"osworld/{t}" for t in (CHROME_D, CHROME_E, CHROME_TABS, CALC_G, OS_A, OS_B, OS_INFEASIBLE)]
    assert ot.task_set("train128") == train
    assert ot.task_set("osworld/train128") == train
    assert len(ot.task_set("test_all")) == 8
    # smoke4: feasible, local-only setup; the tabs task (web) and the infeasible one are out.
    assert ot.task_set("smoke4") == [f"osworld/{t}" for t in (CHROME_D, CHROME_E, OS_A, OS_B)]
    assert ot.task_set("chrome10") == train[:3]  # fewer than 10 chrome tasks: all of them
    assert ot.task_set("subset32") == train[:-1]  # fewer than 32: all feasible tasks of train128
    assert "NOT ARPO's subset" in ot.task_set_source("subset32")
    assert ot.task_set_by_domain("smoke4") == {"chrome": [CHROME_D, CHROME_E], "os": [OS_A, OS_B]}
    with pytest.raises(ValueError, match="Did you mean 'subset32'"):
        ot.task_set("subset23")
    assert set(ot.TASK_SETS) == {"train128", "subset32", "smoke4", "chrome10", "test_all", "sandbox_solved"}
    assert ot.task_set("sandbox_solved") == []  # none of the fixture's tasks has a sandbox solution


@pytest.mark.parametrize("listed", ot.SUBSET32_LISTS)
def test_subset32_uses_the_forks_list_when_present(tmp_path, listed):
    """test_subset32.json (what the fork has), else test_success_middle_difficult.json (what ARPO's
    script names)."""
    checkout = tree_copy(tmp_path)
    (checkout / "evaluation_examples" / listed).write_text(json.dumps({"os": [OS_B], "chrome": [CHROME_E]}))
    fetch(checkout, expect=ot.Expectations(lists={listed: 2}, set_sizes={"subset32": 2}))
    assert ot.task_set("subset32") == [f"osworld/{OS_B}", f"osworld/{CHROME_E}"]
    assert ot.task_set_source("subset32") == listed
    # a broken subset list is an error, not a silent fallback
    (checkout / "evaluation_examples" / listed).write_text(json.dumps({"os": ["missing-id"]}))
    with pytest.raises(ot.TaskDataError, match=f"{listed}: os/missing-id is listed"):
        fetch(checkout, force=True, expect=ot.Expectations())


def test_expand_task_names():
    fetch(FIXTURE)
    names = ["miniwob/click-test", "osworld/smoke4", f"osworld/{CALC_H}", "osworld/smoke4", "miniwob/click-test"]
    smoke = ot.task_set("smoke4")
    assert ot.expand_task_names(names) == ["miniwob/click-test", *smoke, f"osworld/{CALC_H}", *smoke,
                                           "miniwob/click-test"]
    assert ot.expand_task_names(["osworld/not-a-set-but-an-id", "other/subset32"]) == \
        ["osworld/not-a-set-but-an-id", "other/subset32"]
    with pytest.raises(ValueError, match=r"Did you mean 'osworld/subset32'\?.*osworld/train128"):
        ot.expand_task_names(["osworld/subset_32"])


def test_expand_task_names_reads_no_data_without_set_names():
    assert ot.expand_task_names(["miniwob/click-test", f"osworld/{OS_A}"]) == ["miniwob/click-test", f"osworld/{OS_A}"]
    with pytest.raises(FileNotFoundError, match="osworld-tasks fetch"):
        ot.expand_task_names(["osworld/train128"])


def test_module_imports_no_heavy_dependencies():
    import subprocess
    import sys

    code = ("import sys, arpo_lib.envs.osworld.tasks; "
            "print(sorted(m for m in ('torch', 'desktop_env', 'requests') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the CLI ----------------------------------------------------------------------------------

def test_cli_fetch_list_verify(tmp_path, capsys):
    assert cli.main(["osworld-tasks", "list"]) == 0
    assert "not fetched" in capsys.readouterr().out
    assert cli.main(["osworld-tasks", "list", "train128"]) == 2
    assert "osworld-tasks fetch" in capsys.readouterr().err

    archive = make_tarball(tmp_path / "osworld.tar.gz")
    assert cli.main(["osworld-tasks", "fetch", "--source", archive.as_uri(), "--no-progress"]) == 2
    assert "per-domain counts" in capsys.readouterr().err  # not ARPO's 128 list: refused by default
    assert cli.main(["osworld-tasks", "fetch", "--source", archive.as_uri(), "--no-progress", "--any-counts"]) == 0
    out = capsys.readouterr().out
    assert "8 tasks" in out and "chrome 3, libreoffice_calc 2, os 3" in out
    assert "unknown commit (from " in out  # printed whole
    assert cli.main(["osworld-tasks", "fetch", "--source", str(archive), "--any-counts"]) == 0
    assert "already cached" in capsys.readouterr().out

    assert cli.main(["osworld-tasks", "list"]) == 0
    out = capsys.readouterr().out
    assert "train128       7" in out and "smoke4         4" in out
    assert cli.main(["osworld-tasks", "list", "smoke4"]) == 0
    out = capsys.readouterr().out
    assert "chrome                     2" in out and "total                      4" in out
    assert cli.main(["osworld-tasks", "list", "osworld/smoke4", "--ids"]) == 0
    assert capsys.readouterr().out.split() == ot.task_set("smoke4")
    assert cli.main(["osworld-tasks", "list", "nope"]) == 2
    assert "Sets: train128" in capsys.readouterr().err

    assert cli.main(["osworld-tasks", "verify"]) == 0
    assert capsys.readouterr().out.startswith("ok: 11 files")
    (ot.examples_dir() / ot.TEST_ALL_LIST).write_text("{}")
    assert cli.main(["osworld-tasks", "verify"]) == 1
    assert "test_all.json: modified" in capsys.readouterr().out

    assert cli.main(["osworld-tasks", "fetch", "--force", "--pinned", "--source", str(FIXTURE)]) == 2
    assert "per-domain counts" in capsys.readouterr().err
    assert cli.main(["osworld-tasks", "verify"]) == 1  # the failed fetch left the (damaged) cache as it was
