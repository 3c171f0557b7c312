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
