"""Files for the action server: reading what a checker asks for (never blocking on a FIFO the agent
planted), path kinds, and the multipart bodies of OSWorld's uploads.
"""
from __future__ import annotations

import os
import stat
from typing import Any

from desktop_sandbox.http_input import RequestError, safe

MAX_UPLOAD_BYTES = 256 * 2**20
"""Largest /setup/upload (OSWorld's task files upload documents, images and short videos)."""

MAX_FILE_BYTES = 256 * 2**20
"""/file returns at most this much of a file."""


def read_regular(path: str) -> bytes | None:
    """At most MAX_FILE_BYTES of a regular file; None if it is absent or not a regular file. Opened
    without blocking: the agent may have put a FIFO where the checker looks, whose plain open would
    wait for a writer forever (the episode then an infrastructure failure instead of a 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES]
    except OSError:
        return None


_KINDS = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "fifo",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "character special file", stat.S_IFBLK: "block special file"}


def path_kinds(paths: list[str], expand: Any) -> dict[str, dict[str, Any] | None]:
    """{path: {"kind", "mode"} or None} by lstat, `expand` turning `~/...` into the home's path."""
    info: dict[str, dict[str, Any] | None] = {}
    for path in paths:
        try:
            st = os.lstat(expand(path))
        except (OSError, ValueError):
            info[path] = None
            continue
        info[path] = {"kind": _KINDS.get(stat.S_IFMT(st.st_mode), "unknown"), "mode": stat.S_IMODE(st.st_mode)}
    return info


def multipart_fields(content_type: str, raw: bytes) -> dict[str, bytes]:
    """The fields of a multipart/form-data body (OSWorld's /setup/upload: file_path, file_data)."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise RequestError(400, f"expected multipart/form-data, got {safe(kind.strip()) or 'no Content-Type'}")
    boundary = next((p.split("=", 1)[1].strip().strip('"') for p in params.split(";")
                     if p.strip().lower().startswith("boundary=")), "")
    if not boundary:
        raise RequestError(400, "multipart body without a boundary")
    fields: dict[str, bytes] = {}
    for part in raw.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            raise RequestError(400, "malformed multipart part")
        name = None
        for line in head.decode(errors="replace").split("\r\n"):
            if line.lower().startswith("content-disposition:"):
                for item in line.split(";")[1:]:
                    key, _, val = item.strip().partition("=")
                    if key.lower() == "name":
                        name = val.strip('"')
        if name is not None:
            fields[name] = value[:-2] if value.endswith(b"\r\n") else value
    return fields
