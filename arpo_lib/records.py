"""Small torch-free helpers for the run directory's records (metrics.jsonl, task names)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one line and fsync: a killed run loses at most the line being written."""
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


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


def domain_of(task: str) -> str:
    """`miniwob/click-test` -> `miniwob`; a task name without a prefix belongs to `default`."""
    return task.split("/", 1)[0] if "/" in task else "default"
