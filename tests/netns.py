"""Another host for network tests: a network namespace joined to this machine by a veth pair
(root and iproute2 needed). Used by the sandbox's user-mode network tests and the serving
gateway's."""
from __future__ import annotations

import random
import subprocess
import uuid
from contextlib import contextmanager
from typing import Iterator


class NamespaceUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2)."""


@contextmanager
def veth_namespace(ip: str, prefix: str) -> Iterator[tuple[str, str]]:
    """Yields (namespace, net): this machine is `net`.1 and the namespace `net`.2 on a /24, the
    namespace's loopback up; both are removed afterwards. `prefix` (two letters) tells the
    tests' namespaces and interfaces apart."""
    tag = uuid.uuid4().hex[:6]
    net = f"10.{random.randint(200, 250)}.{random.randint(0, 250)}"
    ns, outer, inner = f"arpo-{prefix}-{tag}", f"arpo{prefix}o{tag}", f"arpo{prefix}i{tag}"

    def run(*args: str) -> None:
        subprocess.run(list(args), check=True, capture_output=True, timeout=30)

    try:
        run(ip, "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise NamespaceUnavailable(f"no network namespaces here (root and iproute2 needed): {exc}") from exc
    try:
        run(ip, "link", "add", outer, "type", "veth", "peer", "name", inner)
        run(ip, "link", "set", inner, "netns", ns)
        run(ip, "addr", "add", f"{net}.1/24", "dev", outer)
        run(ip, "link", "set", outer, "up")
        run(ip, "netns", "exec", ns, ip, "addr", "add", f"{net}.2/24", "dev", inner)
        run(ip, "netns", "exec", ns, ip, "link", "set", inner, "up")
        run(ip, "netns", "exec", ns, ip, "link", "set", "lo", "up")
        yield ns, net
    finally:
        subprocess.run([ip, "link", "del", outer], capture_output=True)
        subprocess.run([ip, "netns", "del", ns], capture_output=True)
