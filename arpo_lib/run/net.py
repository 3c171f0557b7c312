"""Network facts every layer may need."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True when `host` binds only this machine: `localhost`, 127.0.0.0/8 or ::1. A host name is
    not: it may resolve to any interface."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


MIN_REACHABLE_KEY_CHARS = 16
"""The shortest API key a server beyond loopback accepts. Clients with a fixed key must not pass as
protected: the OSWorld fork's UI-TARS agent sends `api_key="empty"` (keep such a server on
loopback, reached through an SSH tunnel)."""


def weak_key_reason(key: str | None, host: str) -> str | None:
    """Why `key` cannot protect a server listening on `host`, or None when it can (or the host is
    loopback, where no key is needed)."""
    if is_loopback(host) or key is None:
        return None
    if len(key) < MIN_REACHABLE_KEY_CHARS:
        return (f"an API key of {len(key)} characters cannot protect a server on {host!r} (at least "
                f"{MIN_REACHABLE_KEY_CHARS}, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`). "
                "A client with a fixed key (the OSWorld fork's runner sends 'empty') must reach a server "
                "on 127.0.0.1 through an SSH tunnel instead")
    return None
