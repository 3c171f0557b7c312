"""Fetching a directory tree safely: download with retries, extract one subtree of an archive
refusing anything that could leave it, copy a checkout, hash every file, swap into place.

Generic (no knowledge of what is fetched; the OSWorld task cache, `arpo_lib.envs.osworld.task_cache`,
uses it for the task data, and the set-ups' download cache for their files) and
standard library only.
"""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import lzma
import os
import re
import shutil
import tarfile
import time
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from arpo_lib.run.records import fsync_dir

DOWNLOAD_TIMEOUT_S = 60.0
"""Socket timeout of each connect/read."""
DOWNLOAD_ATTEMPTS = 4
DOWNLOAD_BACKOFF_S = 2.0
"""Wait before retry k (1-based) is DOWNLOAD_BACKOFF_S * 2**(k-1)."""
MAX_ARCHIVE_BYTES = 2 << 30


class FetchError(RuntimeError):
    """A download, archive or source was refused or failed; the message says why."""


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _progress_bar(total: int | None, desc: str, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency of the workbench, but the bar is cosmetic
        return contextlib.nullcontext(_NoBar())
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def download(url: str, path: Path, progress: bool, *, max_bytes: int = MAX_ARCHIVE_BYTES, hint: str = "",
             desc: str = "download") -> tuple[str, int]:
    """Stream `url` into `path`; (sha256, bytes). Retries network errors and 5xx/429 with
    exponential back-off; a 4xx other than 429 fails at once (a wrong URL will not heal)."""
    request = urllib.request.Request(url, headers={"User-Agent": "arpo-workbench"})
    last: BaseException | None = None
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as resp, open(path, "wb") as fh:
                length = resp.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                digest, n = hashlib.sha256(), 0
                with _progress_bar(total, desc, progress) as bar:
                    while chunk := resp.read(1 << 20):
                        n += len(chunk)
                        if n > max_bytes:
                            raise FetchError(f"{url} is larger than {max_bytes} bytes")
                        fh.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                if total is not None and n != total:
                    raise http.client.IncompleteRead(b"", total - n)
                return digest.hexdigest(), n
        except urllib.error.HTTPError as exc:
            if exc.code < 500 and exc.code != 429:
                raise FetchError(f"could not download {url}: HTTP {exc.code} {exc.reason}") from exc
            last = exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            last = exc
        if attempt < DOWNLOAD_ATTEMPTS:
            time.sleep(DOWNLOAD_BACKOFF_S * 2 ** (attempt - 1))
    reason = getattr(last, "reason", None) or last
    raise FetchError(
        f"could not download {url} after {DOWNLOAD_ATTEMPTS} attempts: {type(last).__name__}: {reason}. {hint}") from last


def safe_parts(name: str) -> tuple[str, ...]:
    """The path components of an archive member name; FetchError for absolute or `..` paths."""
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name:
        raise FetchError(f"archive member {name!r} has an absolute or non-POSIX path: refusing the archive")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise FetchError(f"archive member {name!r} leaves the archive ('..'): refusing the archive")
    return parts


def link_target(rel: tuple[str, ...], linkname: str, symbolic: bool, top: tuple[str, ...], subdir: str) -> tuple[str, ...]:
    """Where a link member points, relative to `subdir`/; FetchError if outside.
    A symbolic link is relative to its own directory, a hard link names an archive path."""
    if linkname.startswith("/"):
        raise FetchError(f"link {'/'.join(rel)} -> {linkname!r} is absolute: refusing the archive")
    parts = list(rel[:-1]) if symbolic else []
    raw = linkname.split("/")
    if not symbolic:
        prefix = list(top) + [subdir]
        if raw[: len(prefix)] != prefix:
            raise FetchError(f"hard link {'/'.join(rel)} -> {linkname!r} points outside {subdir}/")
        raw = raw[len(prefix):]
    for p in raw:
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                raise FetchError(f"link {'/'.join(rel)} -> {linkname!r} points outside {subdir}/")
            parts.pop()
        else:
            parts.append(p)
    return tuple(parts)


def extract_subtree(archive: Path, out: Path, subdir: str, max_bytes: int) -> str | None:
    """Extract only `subdir/` of a tarball into `out/subdir/`.

    Every member name is checked (absolute paths and `..` refuse the whole archive). Only
    directories and regular files are written (with our own permissions, never the archive's);
    links inside evaluation_examples/ become copies of their target, links leaving it refuse
    the archive, devices and fifos refuse it. Returns the commit the archive names (git
    archive's pax comment or GitHub's `<repo>-<sha>/` top directory), or None.
    """
    dest = out / subdir
    links: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    top: tuple[str, ...] | None = None
    written = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                parts = safe_parts(member.name)
                if parts[:1] == (subdir,):
                    here, rel = (), parts[1:]
                elif parts[1:2] == (subdir,):
                    here, rel = parts[:1], parts[2:]
                else:
                    continue
                if top is None:
                    top = here
                elif here != top:
                    raise FetchError(f"archive has {subdir}/ under both {'/'.join(top) or '.'} and "
                                        f"{'/'.join(here) or '.'}: refusing the archive")
                target = dest.joinpath(*rel)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                elif member.isfile():
                    written += member.size
                    if written > max_bytes:
                        raise FetchError(f"{subdir}/ in {archive} exceeds {max_bytes} bytes")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(member)
                    with src, open(target, "wb") as fh:
                        shutil.copyfileobj(src, fh)
                elif member.issym() or member.islnk():
                    links.append((rel, link_target(rel, member.linkname, member.issym(), top, subdir)))
                else:
                    raise FetchError(f"archive member {member.name!r} is a device or fifo: refusing the archive")
            commit = (tar.pax_headers or {}).get("comment")  # git archive writes the commit here
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as exc:
        raise FetchError(f"could not read {archive} as a tar archive ({type(exc).__name__}: {exc})") from exc
    if top is None:
        raise FetchError(f"{archive} has no {subdir}/ directory (at its root or under one top directory)")
    _materialise_links(dest, links, subdir)
    if top and not commit:
        m = re.search(r"-([0-9a-f]{40})$", top[0])
        commit = m.group(1) if m else None
    return commit if commit and re.fullmatch(r"[0-9a-f]{40}", commit) else None


def _materialise_links(dest: Path, links: list[tuple[tuple[str, ...], tuple[str, ...]]], subdir: str) -> None:
    """Write each link as a copy of its target file (links to links resolve in later passes)."""
    pending = list(links)
    while pending:
        left = [(rel, target) for rel, target in pending if not dest.joinpath(*target).is_file()]
        for rel, target in pending:
            if (rel, target) not in left:
                dest.joinpath(*rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(dest.joinpath(*target), dest.joinpath(*rel))
        if len(left) == len(pending):
            rel, target = left[0]
            raise FetchError(f"link {subdir}/{'/'.join(rel)} -> {'/'.join(target)} does not point to a "
                                "regular file of the archive: refusing the archive")
        pending = left


def copy_tree(src: Path, out: Path, subdir: str, max_bytes: int) -> None:
    """Copy the directory `src` to `out/subdir/` (regular files; links inside it as copies)."""
    src_real = src.resolve()
    dest = out / subdir
    written = 0
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        rel_dir = here.relative_to(src)
        for name in dirnames + filenames:
            path = here / name
            if path.is_symlink():
                real = path.resolve()
                if not real.is_relative_to(src_real):
                    raise FetchError(f"{path} links outside {src}: refusing the source")
                if real.is_dir():
                    raise FetchError(f"{path} is a link to a directory: not supported, refusing the source")
        (dest / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            path = here / name
            real = path.resolve()
            if not real.is_file():
                raise FetchError(f"{path} is not a regular file: refusing the source")
            written += real.stat().st_size
            if written > max_bytes:
                raise FetchError(f"{src} exceeds {max_bytes} bytes")
            shutil.copyfile(real, dest / rel_dir / name)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(ee: Path, prefix: str) -> dict[str, str]:
    """`<prefix>/<rel>` -> sha256 of every file under `ee`, sorted by path."""
    return {f"{prefix}/{p.relative_to(ee).as_posix()}": sha256_file(p)
            for p in sorted(ee.rglob("*")) if p.is_file()}


def tree_sha256(files: Mapping[str, str]) -> str:
    """sha256 of `sha256sum`-style lines `<sha>  <path>\\n`, sorted by path."""
    return hashlib.sha256("".join(f"{h}  {p}\n" for p, h in sorted(files.items())).encode()).hexdigest()


@contextlib.contextmanager
def locked(parent: Path, name: str) -> Iterator[None]:
    """One fetch per cache directory at a time (advisory lock; no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(parent / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def swap_into_place(staging: Path, dest: Path) -> None:
    """Rename `staging` to `dest`; an existing `dest` is moved aside first and restored if the
    rename fails (a crash between the two renames leaves `.old-*`, which a later fetch removes)."""
    for stale in dest.parent.glob(f".old-{dest.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    old = None
    if dest.exists():
        old = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
    try:
        os.replace(staging, dest)
    except OSError:
        if old is not None:
            os.replace(old, dest)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
