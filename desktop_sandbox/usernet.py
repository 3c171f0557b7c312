"""A network like OSWorld's VM has, safely: `Sandbox(network="user")` (`env.options.network: user`).

OSWorld's VM reaches the internet; the sandbox has no network by default (a network namespace with
only its loopback). With `network="user"` the sandbox's namespace gets a user-mode network from
pasta (Debian's passt package): a tap interface whose traffic pasta carries out through ordinary
sockets of the host, so the agent reaches what the host reaches, with no privilege and no bridge
on the host. What it must never reach, and how that holds:
- the host's loopback (the workbench's own services, the OSWorld bridge, a vLLM server, anything a
  user runs on 127.0.0.1): pasta maps nothing to it (`--no-map-gw`: the gateway address is not the
  host; the sandbox's 127.0.0.1 is its own loopback), and no port is forwarded either way;
- the host's own addresses (a service listening on 0.0.0.0 would answer on them), link-local
  addresses and the clouds' metadata services (169.254.169.254, fd00:ec2::254, 100.100.100.200):
  rejected by firewall rules in the sandbox's own namespace, set from the host before the agent
  runs anything; the agent cannot change them (no capability inside, seccomp, no nested namespace);
- the sandbox's control server: a Unix socket the host holds, never on any network.
DNS: the sandbox's resolv.conf names `DNS_ADDRESS`, which pasta forwards to the host's resolver
(a loopback resolver such as systemd-resolved's included).

Needs root (pasta and the rules enter the sandbox's namespaces from the host) and the `namespaces`
isolation; `unavailable()` says what is missing. The sandbox's processes are an unprivileged host
uid's (the sandbox's user, or root inside's), whose namespaces pasta, which drops its capabilities
before it opens one, may not open: it opens the namespace through a process of root's without
capabilities that the host places there for as long as pasta starts (`_namespace_holder`).
"""
from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DNS_ADDRESS = "10.0.2.3"
"""The resolver address the sandbox sees; pasta answers it with the host's resolvers."""
BLOCKED_V4 = ("127.0.0.0/8", "169.254.0.0/16", "100.100.100.200/32", "0.0.0.0/8")
"""Always rejected from the sandbox (IPv4): loopback beyond its own interface, link-local (the
metadata service at 169.254.169.254 among them), Alibaba's metadata address, "this network"."""
BLOCKED_V6 = ("::1/128", "fe80::/10", "fd00:ec2::254/128")
"""Always rejected (IPv6): loopback, link-local, AWS's IPv6 metadata address."""
START_TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the user-mode network cannot be given here, or None."""
    if os.geteuid() != 0:
        return "env.options.network=user needs root (pasta and its firewall rules enter the sandbox's namespaces)"
    for tool, package in (("pasta", "passt"), ("nsenter", "util-linux"), ("setpriv", "util-linux"),
                          ("iptables", "iptables"), ("ip", "iproute2")):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return f"env.options.network=user needs {tool} (Debian package {package}; ./workbench setup installs it)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def host_addresses() -> tuple[list[str], list[str]]:
    """This machine's own addresses (IPv4, IPv6), every interface: the sandbox may reach none."""
    done = subprocess.run([_tool("ip"), "-j", "addr"], capture_output=True, text=True, timeout=10)
    v4, v6 = [], []
    for interface in json.loads(done.stdout or "[]"):
        for info in interface.get("addr_info", []):
            address = info.get("local")
            if not address:
                continue
            (v6 if ":" in address else v4).append(address)
    return v4, v6


def resolv_conf() -> str:
    return f"nameserver {DNS_ADDRESS}\n"


def sandbox_init_pid(bwrap_pid: int, timeout: float = START_TIMEOUT_S) -> int:
    """The first process inside bubblewrap's namespaces (bwrap's child): its /proc/<pid>/ns/* are
    the sandbox's namespaces."""
    deadline = time.monotonic() + timeout
    own_net = os.readlink("/proc/self/ns/net")
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children").read_text().split()
        except OSError:
            children = []
        for child in children:
            try:
                if os.readlink(f"/proc/{child}/ns/net") != own_net:
                    return int(child)
            except OSError:
                continue
        time.sleep(0.01)
    raise RuntimeError("the sandbox's namespaces did not appear (bubblewrap has no child)")


class UserNetwork:
    """pasta attached to one sandbox's network namespace, and the rules that fence it."""

    def __init__(self, pid: int, workdir: Path) -> None:
        self.pid = pid
        self.pidfile = workdir / "pasta.pid"
        self.log = workdir / "pasta.log"
        self.blocked: list[str] = []
        """The destinations the rules reject (for report())."""

    def start(self) -> None:
        """Rules first (nothing can leave before they hold), then pasta; RuntimeError naming what failed."""
        v4, v6 = host_addresses()
        self.blocked = sorted({*BLOCKED_V4, *BLOCKED_V6, *(f"{a}/32" for a in v4), *(f"{a}/128" for a in v6)})
        enter = [_tool("nsenter"), "--target", str(self.pid), "--net"]
        for table, nets in (("iptables", [*BLOCKED_V4, *(f"{a}/32" for a in v4)]),
                            ("ip6tables", [*BLOCKED_V6, *(f"{a}/128" for a in v6)])):
            for net in nets:
                if ipaddress.ip_network(net, strict=False).subnet_of(ipaddress.ip_network(
                        "127.0.0.0/8" if table == "iptables" else "::1/128")):
                    rule = ["-A", "OUTPUT", "!", "-o", "lo", "-d", net, "-j", "REJECT"]
                else:
                    rule = ["-A", "OUTPUT", "-d", net, "-j", "REJECT"]
                done = subprocess.run([*enter, _tool(table), "-w", *rule], capture_output=True, text=True, timeout=30)
                if done.returncode != 0 and table == "iptables":
                    raise RuntimeError(f"cannot fence the sandbox's network ({table} {' '.join(rule)}): "
                                       f"{done.stderr.strip()[:300]}")
        with _namespace_holder(self.pid) as holder:
            done = subprocess.run(
                [_tool("pasta"), "--quiet", "--runas", "0:0", "--config-net", "--no-map-gw",
                 "-t", "none", "-u", "none", "-T", "none", "-U", "none", "--dns-forward", DNS_ADDRESS,
                 "--pid", str(self.pidfile), "--log-file", str(self.log),
                 # the network namespace alone: the sandbox's user namespace forbids new namespaces
                 # (bubblewrap's --disable-userns), which pasta's own confinement makes; the host's root
                 # holds every capability over the sandbox's namespaces anyway
                 "--netns-only", "--netns", f"/proc/{holder}/ns/net"],
                capture_output=True, text=True, timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not self.pidfile.exists():
            raise RuntimeError(f"pasta did not start (exit {done.returncode}): {done.stderr.strip()[-300:]}")

    def close(self) -> None:
        try:
            os.kill(int(self.pidfile.read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass


@contextlib.contextmanager
def _namespace_holder(pid: int) -> Iterator[int]:
    """A process of root's without capabilities in the network namespace of `pid`, for as long as
    the block runs; its pid. pasta drops its capabilities before it opens /proc/<pid>/ns/net, and
    the kernel then lets it open the namespaces of a process with its own uid and no more
    capabilities only, not those of the sandbox's (an unprivileged uid's)."""
    holder = subprocess.Popen([_tool("nsenter"), "--target", str(pid), "--net", _tool("setpriv"), "--bounding-set",
                               "-all", "--inh-caps", "-all", "--no-new-privs", "sleep", "60"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        target = os.readlink(f"/proc/{pid}/ns/net")
        deadline = time.monotonic() + START_TIMEOUT_S
        while _net_namespace(holder.pid) != target:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nsenter did not enter the sandbox's network namespace")
            time.sleep(0.01)
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def _net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone
        return None
