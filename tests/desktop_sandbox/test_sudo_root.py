"""Root inside the sandbox (`Sandbox(sudo="root")`, desktop_sandbox/superuser.py): `sudo` with the
VM's password gives real root over a writable system layer; packages install and show inside,
never on the host, and the next reset forgets them. With the option off, `sudo` is the shim it was.
The hostile agent with root inside: tests/envs/desktop/test_hostile_as_root.py."""
from __future__ import annotations

import base64
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from desktop_sandbox import confinement, superuser
from desktop_sandbox.sandbox import Sandbox, SandboxError, desktop_unavailable

REASON = desktop_unavailable() or superuser.unavailable()
needs_root_inside = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SCREEN = (800, 600)


def _run(box: Sandbox, command: str, timeout: float = 180) -> dict:
    return box.execute(command, shell=True, timeout=timeout)


def _tiny_deb(where: Path, name: str) -> Path:
    """A .deb with one file under /usr/local/share and a maintainer script that writes to /etc."""
    root = where / name
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: Test <test@example.com>\nDescription: a test package\n")
    postinst = root / "DEBIAN" / "postinst"
    postinst.write_text(f"#!/bin/sh\nset -e\necho configured > /etc/{name}.conf\n")
    postinst.chmod(0o755)
    (root / "usr" / "local" / "share" / name).mkdir(parents=True)
    (root / "usr" / "local" / "share" / name / "hello").write_text("hello from the package\n")
    done = subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(where / f"{name}.deb")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return where / f"{name}.deb"


def _upload(box: Sandbox, data: bytes, path: str) -> None:
    done = box.execute(["sh", "-c", 'printf %s "$1" | base64 -d > "$2"', "sh", base64.b64encode(data).decode(), path])
    assert done["returncode"] == 0, done


def _installed_on_host(package: str) -> bool:
    done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return "install ok installed" in done.stdout


@pytest.mark.slow
@needs_root_inside
@pytest.mark.parametrize("install", ["dpkg -i", "apt-get install -y"])
def test_root_inside_installs_a_package_and_the_next_reset_forgets_it(tmp_path, install):
    name = f"arpo-root-test-{uuid.uuid4().hex[:8]}"
    deb = _tiny_deb(tmp_path, name)
    with Sandbox(SCREEN, sudo="root") as box:
        assert box.report()["sudo"] == "root" and box.report()["root_ids"][1] - box.report()["root_ids"][0] == 65534
        _upload(box, deb.read_bytes(), f"/tmp/{name}.deb")
        touched = _run(box, "echo password | sudo -S touch /usr/local/bin/x && stat -c '%U %a' /usr/local/bin/x")
        assert touched["returncode"] == 0 and touched["output"].strip() == "root 644", touched
        done = _run(box, f"echo password | sudo -S {install} /tmp/{name}.deb")
        assert done["returncode"] == 0, done
        seen = _run(box, f"dpkg-query -W -f='${{Status}}' {name}; echo; cat /usr/local/share/{name}/hello "
                         f"/etc/{name}.conf; stat -c %U /usr/local/share/{name}/hello")
        assert seen["output"].splitlines() == ["install ok installed", "hello from the package", "configured", "root"], seen
        pid = box.process.pid
        assert not Path("/usr/local/bin/x").exists() and not Path(f"/usr/local/share/{name}").exists()
        assert not Path(f"/etc/{name}.conf").exists() and not _installed_on_host(name)
        box.reset_session()
        assert box.process.pid != pid, "the reset after root was granted did not start the sandbox anew"
        gone = _run(box, f"ls /usr/local/bin/x /usr/local/share/{name} /etc/{name}.conf 2>&1; "
                         f"dpkg-query -W -f='${{Status}}' {name} 2>&1")
        assert gone["output"].count("No such file or directory") == 3 and "install ok installed" not in gone["output"], gone
        quiet = box.process.pid
        box.reset_session()  # root not used since: a plain reset
        assert box.process.pid == quiet
    assert not Path("/usr/local/bin/x").exists() and not _installed_on_host(name)


@pytest.mark.slow
@needs_root_inside
def test_root_is_asked_for_the_same_way_and_refused_without_the_password():
    with Sandbox(SCREEN, sudo="root") as box:
        wrong = _run(box, "echo wrong | sudo -S id -u")
        assert wrong["returncode"] == 1 and "Sorry, try again." in wrong["error"], wrong
        assert not box.grants.granted()
        assert _run(box, "sudo -n id -u")["returncode"] == 1
        user = _run(box, "id -u; touch /usr/local/bin/y")
        assert user["output"].split() == ["1000"] and "Permission denied" in user["error"], user  # `user` is no root
        right = _run(box, "echo password | sudo -S id -u; echo password | sudo -S -u user id -un; "
                          "echo password | sudo -S -i pwd; echo password | sudo -S printenv HOME SUDO_USER PATH")
        assert right["output"].split()[:6] == ["0", "user", "/root", "/root", "user",
                                               "/opt/arpo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], right
        assert box.grants.granted()
        # the broker itself asks for the password: talking to it directly is no way around sudo
        direct = _run(box, "cd / && python3 -I -c \"import sys; sys.path[:0] = ['/opt/arpo/lib']; "
                           "from desktop_sandbox.sudo import client; sys.exit(client(['id', '-u'], 'root', False, False, "
                           "False, 'guess'))\"")
        assert direct["returncode"] == 1 and "Sorry" in direct["error"], direct
        status = _run(box, "echo password | sudo -S sh -c 'exit 7'; echo $?; echo password | sudo -S sh -c 'kill -TERM $$'; "
                           "echo $?; echo password | sudo -S no-such-command; echo $?")
        assert status["output"].split() == ["7", "143", "1"] and "command not found" in status["error"], status


@pytest.mark.slow
@needs_root_inside
def test_osworlds_provider_keeps_its_bridge_across_the_new_sandbox_a_revert_makes():
    """OSWorld's controllers reach the sandbox through the host's loopback bridge, made once for
    the socket path: after root was granted, OSWorld's revert starts a new sandbox behind the same
    path, and the same address answers, from a fresh system."""
    import requests

    from desktop_sandbox.osworld import SandboxProvider

    provider = SandboxProvider(screen_size=SCREEN, sandbox_options={"window_manager": "openbox", "sudo": "root"})
    try:
        provider.start_emulator("desktop-sandbox", headless=True)
        host, port = provider.get_ip_address("desktop-sandbox").split(":")[:2]
        base = f"http://{host}:{port}"

        def run(command: str) -> dict:
            return requests.post(f"{base}/execute", json={"command": command, "shell": True}, timeout=120).json()

        assert run("echo password | sudo -S touch /usr/local/bin/x; ls /usr/local/bin/x")["returncode"] == 0
        first = provider.box.process.pid
        provider.revert_to_snapshot("desktop-sandbox", "init_state")
        assert provider.box.process.pid != first
        after = run("ls /usr/local/bin/x; whoami")
        assert "No such file or directory" in after["error"] and after["output"] == "user\n", after
    finally:
        provider.stop_emulator("desktop-sandbox")


@pytest.mark.slow
@pytest.mark.skipif(desktop_unavailable() is not None, reason=desktop_unavailable() or "")
def test_with_the_option_off_sudo_is_the_shim_it_was():
    with Sandbox(SCREEN) as box:
        assert box.report()["sudo"] == "user" and box.report()["root_ids"] is None and box.grants is None
        shim = _run(box, "cat /opt/arpo/bin/sudo")["output"]
        assert shim == confinement.SUDO_SHIM
        done = _run(box, "echo password | sudo -S id -u; echo password | sudo -S touch /usr/local/bin/x; ls /run/sudo")
        assert done["output"].split() == ["1000"], done
        assert "Read-only file system" in done["error"] and "No such file or directory" in done["error"], done


def test_sudo_mode_and_the_reasons_root_inside_cannot_run(monkeypatch):
    assert superuser.sudo_mode(None) == "user" and superuser.sudo_mode("root") == "root"
    with pytest.raises(ValueError, match="sudo must be one of"):
        superuser.sudo_mode("admin")
    monkeypatch.setattr(superuser.os, "geteuid", lambda: 1000)
    superuser.unavailable.cache_clear()
    try:
        assert "needs root on the host" in superuser.unavailable()
        monkeypatch.setattr(superuser.os, "geteuid", lambda: 0)
        monkeypatch.setattr(superuser.shutil, "which", lambda name: None if name == "fuse-overlayfs" else "/usr/bin/x")
        superuser.unavailable.cache_clear()
        assert "fuse-overlayfs (Debian package fuse-overlayfs" in superuser.unavailable()
        monkeypatch.setattr(superuser.shutil, "which", lambda name: "/usr/bin/x")
        monkeypatch.setattr(superuser.confinement, "user_namespaces_refused", lambda: "Operation not permitted")
        superuser.unavailable.cache_clear()
        assert "needs user namespaces, which are refused here: Operation not permitted" in superuser.unavailable()
    finally:
        superuser.unavailable.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0 or desktop_unavailable("user") is not None,
                    reason="the dedicated-user fallback needs root")
def test_root_inside_refuses_the_user_fallback_at_start():
    with pytest.raises(SandboxError, match="sudo=root needs the namespaces isolation"):
        Sandbox(SCREEN, sudo="root", isolation="user")


def test_the_seed_hides_the_hosts_secrets_and_gives_the_sandboxs_accounts(tmp_path):
    superuser.write_seed(tmp_path / "seed", os.getuid(), resolv_conf="nameserver 10.0.2.3\n")
    etc = tmp_path / "seed" / "etc"
    shadow = (etc / "shadow").read_text().splitlines()
    assert all(line.split(":")[1] in ("*", superuser.ROOT_PASSWORD_HASH) for line in shadow)
    assert [line.split(":")[0] for line in shadow if line.split(":")[1] != "*"] == ["user"]
    passwd = {line.split(":")[0]: line for line in (etc / "passwd").read_text().splitlines()}
    assert passwd["root"].startswith("root:x:0:0:") and passwd["user"].startswith("user:x:1000:1000:")
    assert all(int(line.split(":")[2]) < 1000 or int(line.split(":")[2]) in (1000, 65534) for line in passwd.values())
    for kind, path in confinement.etc_masks():  # every secret and unreadable entry: empty, or opaque
        seeded = tmp_path / "seed" / path.lstrip("/")
        assert seeded.exists(), path
        if kind == "dir":
            assert (seeded / ".wh..wh..opq").is_file() and list(seeded.iterdir()) == [seeded / ".wh..wh..opq"]
        elif Path(path).name not in ("passwd", "group", "hostname", "hosts", "machine-id", "shadow", "gshadow",
                                     "resolv.conf"):
            assert seeded.stat().st_size == 0, path
    assert (etc / "resolv.conf").read_text() == "nameserver 10.0.2.3\n"
    assert (tmp_path / "seed" / "var" / "lib" / "dpkg" / "lock-frontend").is_file()
