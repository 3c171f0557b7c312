"""Durable, torch-free file writes and reads for run records (metrics.jsonl, manifests, names)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one line and fsync: a killed run loses at most the line being written."""
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry itself is data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON-object lines of a file; a line torn by a crash is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def safe_name(text: str) -> str:
    """Any text (a task id, a label) as one safe path component: only `A-Za-z0-9._-`, never
    empty, never `.` or `..`, never hidden, at most 120 characters."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._") or "task"
    return name[:120]


def safe_join(base: str | os.PathLike[str], *parts: str) -> Path:
    """`base/part/...` with each untrusted part made a safe component; the result is always
    inside `base` (checked, not assumed)."""
    base = Path(base)
    path = base.joinpath(*(safe_name(p) for p in parts))
    if not path.resolve().is_relative_to(base.resolve()):
        raise ValueError(f"{parts!r} would leave {base}")
    return path
