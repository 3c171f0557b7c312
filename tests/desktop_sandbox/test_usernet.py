"""`network="user"` (desktop_sandbox/usernet.py): the agent reaches outside addresses, like
OSWorld's VM, and never the host's loopback, the host's own addresses, link-local or metadata
addresses. "Outside" here is a test host the test makes in a network namespace of its own."""
from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import threading

import pytest

from desktop_sandbox import usernet
from desktop_sandbox.sandbox import Sandbox, desktop_unavailable, network_mode
from tests.netns import veth_namespace

REASON = desktop_unavailable() or usernet.unavailable()
SCREEN = (800, 600)


def test_network_modes_are_named_and_the_old_booleans_keep_their_meaning():
    assert [network_mode(v) for v in (False, None, True, "none", "user", "host")] == \
        ["none", "none", "host", "none", "user", "host"]
    with pytest.raises(ValueError, match="network must be one of"):
        network_mode("bridge")
    assert usernet.resolv_conf() == f"nameserver {usernet.DNS_ADDRESS}\n"


@pytest.fixture
def test_host():
    """An outside host: a network namespace with a veth pair to this machine, an HTTP server in it."""
    ip = usernet._tool("ip")
    with veth_namespace(ip, "th") as (ns, net):
        tag = ns.rsplit("-", 1)[1]
        server = subprocess.Popen([ip, "netns", "exec", ns, "python3", "-c", textwrap.dedent(f"""\
            import http.server
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.end_headers(); self.wfile.write(b"outside {tag}")
                def log_message(self, *a): pass
            http.server.HTTPServer(("{net}.2", 8080), H).serve_forever()
            """)])
        try:
            yield f"{net}.2", tag
        finally:
            server.kill()
            server.wait()


@pytest.fixture
def host_services():
    """A service on the host's loopback and one on every host address (0.0.0.0): neither may answer."""
    listeners, hits = [], []
    for address in ("127.0.0.1", "0.0.0.0"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(8)
        listener.settimeout(0.2)
        listeners.append(listener)

    stop = threading.Event()

    def accept(listener):
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
                hits.append(listener.getsockname())
                connection.close()
            except OSError:
                continue

    for listener in listeners:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
    v4, _ = usernet.host_addresses()
    own = [a for a in v4 if not a.startswith("127.")]
    yield {"loopback": listeners[0].getsockname()[1], "any": listeners[1].getsockname()[1], "addresses": own}, hits
    stop.set()
    for listener in listeners:
        listener.close()


_PROBE = r"""
import json, socket, sys, urllib.request
targets = json.loads(sys.argv[1])
out = {}
for name, (host, port) in targets.items():
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
    finally:
        s.close()
try:
    out["page"] = urllib.request.urlopen(sys.argv[2], timeout=5).read().decode()
except Exception as e:
    out["page"] = type(e).__name__
print(json.dumps(out))
"""


def _probe(box, targets: dict[str, tuple[str, int]], url: str) -> dict[str, str]:
    done = box.execute(["python3", "-c", _PROBE, json.dumps(targets), url], timeout=60)
    assert done["returncode"] == 0, done
    return json.loads(done["output"])


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_the_user_network_reaches_outside_and_nothing_of_the_host(test_host, host_services):
    outside, tag = test_host
    ports, hits = host_services
    targets = {"outside": (outside, 8080), "host loopback": ("127.0.0.1", ports["loopback"]),
               "metadata": ("169.254.169.254", 80), "gateway": ("192.0.2.1", ports["any"])}
    for n, address in enumerate(ports["addresses"]):
        targets[f"host address {n}"] = (address, ports["any"])
    with Sandbox(SCREEN, window_manager="openbox", network="user") as box:
        seen = _probe(box, targets, f"http://{outside}:8080/")
        assert seen["outside"] == "connected" and seen["page"] == f"outside {tag}", seen
        for name, result in seen.items():
            if name not in ("outside", "page"):
                assert result != "connected", (name, seen)
        assert box.report()["network"] == "user" and "169.254.0.0/16" in box.report()["network_fenced"]
        # the sandbox's user is an unprivileged host uid (pasta, dropping its capabilities, may not
        # open that uid's namespace itself: it is given one of root's without capabilities in it)
        assert box.report()["host_uid"] is not None, box.describe()
        # the agent cannot lift the fence: no capability inside, and iptables is root's
        lift = box.execute("iptables -F OUTPUT; echo $?", shell=True)
        assert lift["output"].strip() != "0", lift
        assert _probe(box, {"metadata": ("169.254.169.254", 80)}, "http://169.254.169.254/")["metadata"] != "connected"
    assert hits == [], f"a host service answered the sandbox: {hits}"
    with Sandbox(SCREEN, window_manager="openbox") as box:  # the default: no network at all
        seen = _probe(box, {"outside": (outside, 8080)}, f"http://{outside}:8080/")
        assert seen["outside"] != "connected" and seen["page"] != f"outside {tag}", seen
