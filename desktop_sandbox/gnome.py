"""OSWorld's computer in the sandbox: the GNOME desktop of OSWorld's Ubuntu 22.04 VM image
(`Sandbox(window_manager="gnome")`, the default of OSWorld's `provider: sandbox`).

What the agent sees and drives, as on the VM: GNOME Shell on X11 (Mesa's software rendering under
Xvfb), Ubuntu's session (the Yaru theme, the Ubuntu font, Ubuntu's dock on the left through
Dash to Dock, the top bar, the overview on Super, the "Run a Command" dialog on Alt+F2, the VM
image's favourites that are installed here), GNOME Terminal on Ctrl+Alt+T, Nautilus as Files,
GSettings and dconf working (OSWorld's GNOME-settings tasks read them), the user `user` with
`/home/user`, the session bus at `/run/user/1000/bus` (OSWorld's task files name it).

How, in two halves:
- the host writes the session's read-only files once per sandbox (`write_session_files`): the
  `ubuntu` session mode of GNOME Shell (Debian ships none), Ubuntu's settings as a dconf database
  below the user's own (`DCONF_PROFILE`: what the agent changes lands in its home, `dconf reset`
  goes back to Ubuntu's values, as Ubuntu's own defaults behave), and the configuration of a
  private system bus (GNOME Shell refuses to start without one; nothing of the host's is reached);
- the action server starts the session at every reset (`Session.start`), after the home was
  emptied and the episode's session bus started: the system bus, PulseAudio (where installed),
  gnome-shell, the settings daemon's xsettings (GTK's theme and fonts) and media-keys (the
  shortcuts) plugins. A reset ends
  them with every other process of the episode: nothing the agent did to its desktop (an
  extension, a setting, a killed shell) outlives the episode.

Departures from the VM, on purpose or from what Debian has (docs/desktop.md lists them all):
animations are off (software rendering, and screenshots taken mid-animation); Ctrl+Alt+T is a
custom shortcut of the settings daemon (Ubuntu patches a built-in one that Debian's GNOME 43
lacks); the background is a gradient in the colours of Ubuntu's wallpaper (its image is not in
Debian); the services a VM's session runs that no task needs are not started (evolution's
calendar, tracker, gvfs network mounts, update notifiers, gnome-session itself).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

DESKTOP_KINDS = ("openbox", "gnome")
"""What `Sandbox(window_manager=...)` may run: openbox (our own desktop tasks, the smoke: cheap, no
launcher) or GNOME (OSWorld's VM image)."""

REQUIRED = {
    "gnome-shell": "gnome-shell", "gnome-terminal": "gnome-terminal", "nautilus": "nautilus",
    "dconf": "dconf-cli", "gsettings": "libglib2.0-bin", "dbus-daemon": "dbus-daemon",
    "/usr/libexec/gsd-media-keys": "gnome-settings-daemon", "/usr/libexec/gsd-xsettings": "gnome-settings-daemon",
    "/usr/share/gnome-shell/extensions/dash-to-dock@micxgx.gmail.com": "gnome-shell-extension-dashtodock",
    "/usr/share/gnome-shell/theme/Yaru/gnome-shell.css": "yaru-theme-gnome-shell",
    "/usr/share/themes/Yaru": "yaru-theme-gtk",
    "/usr/share/icons/Yaru": "yaru-theme-icon",
}
"""What the GNOME desktop needs here: a command or a path, and the Debian package that has it."""
OPTIONAL = {"/usr/share/fonts/truetype/ubuntu": "fonts-ubuntu (Debian's non-free)"}
"""Wanted for the VM's look, not needed to run (fonts fall back to DejaVu)."""

SESSION_DIR_NAME = "gnome"
"""Under the sandbox's read-only shim directory: the session mode, the dconf defaults, the bus config."""
RUNTIME_DIR = "/run/user/1000"
"""XDG_RUNTIME_DIR inside the sandbox: OSWorld's task files reach the session bus at /run/user/1000/bus."""
SYSTEM_BUS_SOCKET = "/run/dbus/system_bus_socket"
"""Where the private system bus listens (the standard path, so programs that ignore the variable find it)."""
START_TIMEOUT_S = 30.0
"""GNOME Shell must be up within this long (~1.2 s here on an idle 2-core machine)."""
SETTLE_S = 0.3
"""After the shortcuts' plugin is on the bus: its keys are grabbed within this (measured ~0.1 s)."""

FAVORITES = ("google-chrome.desktop", "thunderbird.desktop", "code.desktop", "vlc.desktop",
             "libreoffice-writer.desktop", "libreoffice-calc.desktop", "libreoffice-impress.desktop", "gimp.desktop",
             "org.gnome.Nautilus.desktop", "snap-store_ubuntu-software.desktop", "yelp.desktop")
"""The dock's favourites on OSWorld's VM image, in its order (as a project that rebuilt the image
recorded them, cross-checked with agents' clicks on the VM's dock; docs/desktop.md). Those not
installed here (Ubuntu Software, Help; VS Code where setup_vscode.sh could not run) are not shown,
as GNOME does with any favourite it cannot find. The terminal is not pinned on the VM either: Ctrl+Alt+T opens it."""
APPLICATIONS = Path("/usr/share/applications")
GRID = {
    **{name: {"NoDisplay": "true"} for name in ("chromium.desktop", "org.xfce.mousepad.desktop", "pcmanfm.desktop",
                                                 "st.desktop")},
    "org.gnome.gedit.desktop": {"Name": "Text Editor"},
}
"""The application grid as on the VM, as changes to the host's desktop entries (a changed copy
earlier in XDG_DATA_DIRS shadows each): hidden are the openbox desktop's editor, file manager and
terminal and Chromium's own entry (the dock's Chrome is `google-chrome.desktop`, the shim), which
the VM's grid has not (they still run when named); gedit is "Text Editor", its name on the VM's
Ubuntu 22.04 (Debian's gedit 44 calls itself gedit)."""
TEXT_EDITOR = "org.gnome.gedit.desktop"
"""The VM's text editor (gedit): what a text file opens in on GNOME where it is installed
(./workbench setup installs it), as OSWorld's task files expect (a set-up activates
"restaurants.txt (~/Desktop) - gedit")."""
TEXT_TYPES = ("text/plain", "text/x-python", "text/x-csrc", "text/markdown", "application/x-shellscript",
              "application/json")
TIMEZONE = "Asia/Hong_Kong"
"""The VM's time zone (its clock, `date`, file times in the terminal)."""

SESSION_MODE = {
    "parentMode": "user",
    "stylesheetName": "Yaru/gnome-shell.css",
    "themeResourceName": "theme/Yaru/gnome-shell-theme.gresource",
    "enabledExtensions": ["dash-to-dock@micxgx.gmail.com"],
}
"""GNOME Shell's `ubuntu` session mode (Ubuntu's file less its extensions not in Debian: desktop
icons and app indicators)."""


def _gvariant_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


UBUNTU_SETTINGS = f"""\
# Ubuntu 22.04's settings for the sandbox's GNOME session (desktop_sandbox/gnome.py): a dconf
# database below the user's own, so that what the agent sets lands in its home and `reset` goes back here.
[org/gnome/shell]
favorite-apps={_gvariant_list(FAVORITES)}
welcome-dialog-last-shown-version='999'

[org/gnome/shell/extensions/dash-to-dock]
dock-position='LEFT'
extend-height=true
dock-fixed=true
dash-max-icon-size=48
disable-overview-on-startup=true
show-trash=true
show-mounts=false
click-action='focus-or-previews'
running-indicator-style='DOTS'
transparency-mode='FIXED'
background-opacity=0.8
custom-theme-shrink=true
apply-custom-theme=false

[org/gnome/desktop/interface]
gtk-theme='Yaru'
icon-theme='Yaru'
cursor-theme='Yaru'
font-name='Ubuntu 11'
document-font-name='Sans 11'
monospace-font-name='Ubuntu Mono 13'
enable-animations=false
clock-show-date=true

[org/gnome/desktop/wm/preferences]
button-layout='appmenu:minimize,maximize,close'
titlebar-font='Ubuntu Bold 11'

[org/gnome/terminal/legacy]
theme-variant='dark'

[org/gnome/desktop/background]
picture-uri=''
picture-uri-dark=''
picture-options='none'
color-shading-type='vertical'
primary-color='#E95420'
secondary-color='#77216F'

[org/gnome/desktop/screensaver]
picture-uri=''
picture-options='none'
primary-color='#E95420'
secondary-color='#77216F'

[org/gnome/settings-daemon/plugins/media-keys]
custom-keybindings=['/org/gnome/settings-daemon/plugins/media-keys/custom-keybindings/terminal/']

[org/gnome/settings-daemon/plugins/media-keys/custom-keybindings/terminal]
name='Terminal'
command='gnome-terminal'
binding='<Primary><Alt>t'
"""
"""Ubuntu's look and the VM's shortcuts, as dconf settings (dconf's keyfile format)."""

UNWANTED_SERVICES = ("org.freedesktop.Tracker3.", "org.gnome.Nautilus.Tracker3.", "org.freedesktop.portal.Tracker",
                     "org.freedesktop.LocalSearch", "org.gnome.evolution.", "org.gnome.Shell.CalendarServer",
                     "org.gnome.OnlineAccounts", "org.gnome.Identity", "org.gtk.vfs.GoaVolumeMonitor",
                     "org.gtk.vfs.AfcVolumeMonitor", "org.gtk.vfs.GPhoto2VolumeMonitor", "org.gtk.vfs.MTPVolumeMonitor",
                     "org.gtk.vfs.UDisks2VolumeMonitor", "org.freedesktop.systemd1", "org.freedesktop.Telepathy",
                     "org.gtk.GLib.PACRunner", "org.fedoraproject.Config.Printing")
"""Session services (file name prefixes under /usr/share/dbus-1/services) a VM's session starts and
no task needs: the file indexer (tracker, which Nautilus would start), evolution's calendar and
address book, online accounts, network and device volume monitors, systemd's user manager (there
is none), the proxy-autoconfig runner, printing. Every other service of the system's directory
can be started, as on the VM; none from the home (the agent cannot add one)."""
SESSION_BUS_CONFIG = """\
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- The GNOME session's bus (desktop_sandbox/gnome.py): the openbox desktop's dbus-session.conf
     with a service directory of the host's read-only copies less UNWANTED_SERVICES. -->
<busconfig>
  <type>session</type>
  <keep_umask/>
  <listen>unix:tmpdir=/tmp</listen>
  <auth>EXTERNAL</auth>
  <servicedir>{services}</servicedir>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
  <limit name="service_start_timeout">30000</limit>
</busconfig>
"""
SYSTEM_SERVICES = Path("/usr/share/dbus-1/services")

SYSTEM_BUS_CONFIG = f"""\
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- The sandbox's own system bus (desktop_sandbox/gnome.py): GNOME Shell refuses to start
     without one. Empty: no service is started through it (no .service directory), nothing of the
     host's is on it; the session's programs find it and learn that login1, UPower, NetworkManager
     and polkit are absent, as in a container. -->
<busconfig>
  <type>system</type>
  <listen>unix:path={SYSTEM_BUS_SOCKET}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the GNOME desktop cannot run here (naming the Debian packages and the command that
    installs them), or None."""
    missing = sorted({package for need, package in REQUIRED.items()
                      if not (os.path.exists(need) if need.startswith("/") else shutil.which(need))})
    if missing:
        return (f"the GNOME desktop needs Debian's {', '.join(missing)}: `./workbench setup` installs them "
                "(or use the openbox desktop: env.options.desktop=openbox)")
    return None


def write_session_files(directory: Path, inside: str) -> Path:
    """The session's read-only files under `directory/gnome` (the sandbox's shim directory, seen
    as `inside` in the sandbox): the `ubuntu` session mode, Ubuntu's settings compiled into a dconf
    database, the dconf profile naming it, the system bus's configuration. Returns that directory."""
    root = directory / SESSION_DIR_NAME
    (root / "data" / "gnome-shell" / "modes").mkdir(parents=True, exist_ok=True)
    (root / "data" / "gnome-shell" / "modes" / "ubuntu.json").write_text(json.dumps(SESSION_MODE, indent=1) + "\n")
    keyfiles = root / "dconf.d"
    keyfiles.mkdir(exist_ok=True)
    (keyfiles / "00-ubuntu").write_text(UBUNTU_SETTINGS)
    done = subprocess.run(["dconf", "compile", str(root / "ubuntu.db"), str(keyfiles)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dconf compile failed: {done.stderr.strip()[:500]}")
    (root / "dconf-profile").write_text(f"user-db:user\nfile-db:{inside}/{SESSION_DIR_NAME}/ubuntu.db\n")
    _write_application_grid(root)
    (root / "system-bus.conf").write_text(SYSTEM_BUS_CONFIG)
    services = root / "services"
    services.mkdir(exist_ok=True)
    for service in sorted(SYSTEM_SERVICES.glob("*.service")):
        if not service.name.startswith(UNWANTED_SERVICES):
            shutil.copyfile(service, services / service.name)
    (root / "session-bus.conf").write_text(SESSION_BUS_CONFIG.format(services=f"{inside}/{SESSION_DIR_NAME}/services"))
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    root.chmod(0o755)
    return root


def _write_application_grid(root: Path) -> None:
    """The grid as on the VM (GRID's changed copies under `data`, first in XDG_DATA_DIRS), and
    text files opened in gedit where it is installed (`config/gnome-mimeapps.list`, which GNOME
    reads before the sandbox's mimeapps.list)."""
    shadows = root / "data" / "applications"
    shadows.mkdir(parents=True, exist_ok=True)
    for name, changes in GRID.items():
        original = APPLICATIONS / name
        if original.is_file():
            (shadows / name).write_text(_changed_entry(original.read_text(errors="replace"), changes))
    config = root / "config"
    config.mkdir(exist_ok=True)
    if (APPLICATIONS / TEXT_EDITOR).is_file():
        (config / "gnome-mimeapps.list").write_text(
            "# the GNOME desktop's text editor, the VM's gedit (desktop_sandbox/gnome.py)\n[Default Applications]\n"
            + "".join(f"{kind}={TEXT_EDITOR}\n" for kind in TEXT_TYPES))


def _changed_entry(text: str, changes: dict[str, str]) -> str:
    """A desktop entry with `changes` set in its [Desktop Entry] group (its actions untouched)."""
    lines, group, done = [], None, set()
    for line in text.splitlines():
        if line.startswith("["):
            if group == "[Desktop Entry]":
                lines += [f"{key}={value}" for key, value in changes.items() if key not in done]
            group = line.strip()
        elif group == "[Desktop Entry]" and line.split("=", 1)[0] in changes:
            key = line.split("=", 1)[0]
            line = f"{key}={changes[key]}"
            done.add(key)
        lines.append(line)
    if group == "[Desktop Entry]":
        lines += [f"{key}={value}" for key, value in changes.items() if key not in done]
    return "\n".join(lines) + "\n"


def environment(session_dir: str, xdg_data_dirs: str, xdg_config_dirs: str = "/etc/xdg") -> dict[str, str]:
    """What every program of the GNOME desktop gets on top of the sandbox's environment
    (`session_dir`: where write_session_files' directory is seen inside)."""
    return {
        "XDG_SESSION_TYPE": "x11", "XDG_CURRENT_DESKTOP": "ubuntu:GNOME", "XDG_SESSION_DESKTOP": "ubuntu",
        "DESKTOP_SESSION": "ubuntu", "GNOME_SHELL_SESSION_MODE": "ubuntu", "GDMSESSION": "ubuntu",
        "XDG_DATA_DIRS": f"{session_dir}/data:{xdg_data_dirs}",
        "XDG_CONFIG_DIRS": f"{session_dir}/config:{xdg_config_dirs}",
        "DCONF_PROFILE": f"{session_dir}/dconf-profile",
        "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={SYSTEM_BUS_SOCKET}",
        "XDG_RUNTIME_DIR": RUNTIME_DIR, "TZ": TIMEZONE,
    }


HOME_DIRS = ("Desktop", "Documents", "Downloads", "Music", "Pictures", "Public", "Templates", "Videos")
"""The home's folders on Ubuntu (xdg-user-dirs)."""
USER_DIRS = "".join(f'XDG_{name.upper()}_DIR="$HOME/{name}"\n'
                    for name in ("Desktop", "Documents", "Download", "Music", "Pictures", "Public", "Templates",
                                 "Videos")).replace("$HOME/Download\"", "$HOME/Downloads\"")


def seed_home(home: Path) -> None:
    """What a new user's home holds on Ubuntu, written into the emptied home before the session
    starts (as the agent's user): the folders, xdg-user-dirs' file, /etc/skel's shell files (the
    terminal's prompt and title come from ~/.bashrc), and the mark GNOME Shell leaves after
    warning once that the screen cannot be locked without GDM (the VM has GDM: no such warning)."""
    for name in HOME_DIRS:
        (home / name).mkdir(exist_ok=True)
    (home / ".config").mkdir(exist_ok=True)
    (home / ".config" / "user-dirs.dirs").write_text(USER_DIRS)
    skel = Path("/etc/skel")
    for name in (".bashrc", ".profile", ".bash_logout"):
        if (skel / name).is_file():
            shutil.copyfile(skel / name, home / name)
    marks = home / ".local" / "share" / "gnome-shell"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / "lock-warning-shown").touch()
    if Path(PULSEAUDIO).exists():  # the session's sound server reads it (Session.start)
        (home / ".config" / "pulse").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "pulse" / "default.pa").write_text(PULSE_DEFAULT_PA)


PULSEAUDIO = "/usr/bin/pulseaudio"
PULSE_DEFAULT_PA = f""".include /etc/pulse/default.pa
.nofail
set-sink-volume @DEFAULT_SINK@ {int(0.4 * 65536)}
"""
"""The sound server's start-up in the sandbox: the system's (a null output: there is no sound card), at 40%. The VM's
own level is not published; OSWorld's volume task asks to turn a low volume up to the maximum,
so it is below 100% there too."""


class Session:
    """The GNOME session of one episode, started by the action server as the agent's user: the
    private system bus, gnome-shell, and the settings daemon's xsettings and media-keys plugins.
    `spawn()` gives subprocess's keyword arguments for the agent's user (env included: the
    desktop's environment with the episode's session bus). `tap` sends one harmless key event;
    `drawn` says whether the screen shows anything yet."""

    def __init__(self, spawn: Callable[[], dict[str, Any]], log_dir: Path, tap: Callable[[], None],
                 drawn: Callable[[], bool]) -> None:
        self.spawn, self.log_dir, self.tap, self.drawn = spawn, log_dir, tap, drawn
        self.processes: dict[str, subprocess.Popen] = {}
        self.error: str | None = None
        """Why the last start failed (None: it did not)."""

    def start(self) -> None:
        """Start the session; returns once the shell and the shortcuts' plugin are up. RuntimeError
        naming what did not start (its log's tail) otherwise."""
        self.processes = {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kwargs = self.spawn()
        env = kwargs["env"]
        # What an earlier session left in the runtime directory would change this one: GNOME Shell
        # disables every extension (the dock) when its crash guard file is still there.
        subprocess.run(["/bin/sh", "-c", 'rm -rf -- "$0"; mkdir -p "$(dirname "$0")"; cd "$1" && '
                        'find . -mindepth 1 -maxdepth 1 ! -name bus ! -name at-spi -exec rm -rf -- {} +',
                        SYSTEM_BUS_SOCKET, RUNTIME_DIR], stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                       **kwargs)
        session_dir = Path(env["DCONF_PROFILE"]).parent
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            self._run("system-bus", ["dbus-daemon", "--nofork", f"--config-file={session_dir / 'system-bus.conf'}"],
                      kwargs)
            self._wait(lambda: os.path.exists(SYSTEM_BUS_SOCKET), "system-bus", deadline)
            if Path(PULSEAUDIO).exists():  # the VM's session runs its sound server (the shell's volume menu uses it)
                self._run("pulseaudio", [PULSEAUDIO, "--daemonize=no", "--exit-idle-time=-1"], kwargs)
            self._run("gnome-shell", ["gnome-shell", "--x11", "--sm-disable"], kwargs)
            self._wait(lambda: self._shell_ready(env), "gnome-shell", deadline)
            self._run("gsd-xsettings", ["/usr/libexec/gsd-xsettings"], kwargs)
            self._run("gsd-media-keys", ["/usr/libexec/gsd-media-keys"], kwargs)
            self._wait(lambda: self._on_bus("org.gnome.SettingsDaemon.MediaKeys", env), "gsd-media-keys", deadline)
        except RuntimeError as e:
            self.error = str(e)
            raise
        time.sleep(SETTLE_S)
        # The first key event after GNOME Shell starts is lost (mutter re-reads the keymap of the
        # XTEST device that sent it): without this tap the agent's first Ctrl+Alt+T does nothing.
        self.tap()
        self.error = None

    def _run(self, name: str, command: list[str], kwargs: dict[str, Any]) -> None:
        log = open(self.log_dir / f"gnome-{name}.log", "wb")
        try:
            self.processes[name] = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
        finally:
            log.close()

    def _wait(self, ready: Callable[[], bool], name: str, deadline: float) -> None:
        while not ready():
            process = self.processes.get(name)
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{name} exited at start (code {process.returncode}): {self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start within {START_TIMEOUT_S:.0f} s: {self.log_tail(name)}")
            time.sleep(0.05)

    def _ask(self, env: dict[str, str], *args: str) -> str | None:
        """One D-Bus call on the session bus (dbus-send); its literal answer, None on an error."""
        done = subprocess.run(["dbus-send", "--session", "--print-reply=literal", "--reply-timeout=5000", *args],
                              capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL,
                              env=env, cwd="/", **{k: v for k, v in self.spawn().items() if k not in ("env", "cwd")})
        return done.stdout if done.returncode == 0 else None

    def _on_bus(self, name: str, env: dict[str, str]) -> bool:
        answer = self._ask(env, "--dest=org.freedesktop.DBus", "/org/freedesktop/DBus",
                           "org.freedesktop.DBus.NameHasOwner", f"string:{name}")
        return answer is not None and "true" in answer

    def _shell_ready(self, env: dict[str, str]) -> bool:
        """The shell has exported its interface (it owns its name earlier: the settings daemon's
        shortcuts, grabbed through that interface, fail when they come before it) and drawn its
        first frame (the screen is not black)."""
        answer = self._ask(env, "--dest=org.gnome.Shell", "/org/gnome/Shell", "org.freedesktop.DBus.Properties.Get",
                           "string:org.gnome.Shell", "string:ShellVersion")
        return answer is not None and self.drawn() and all(
            self._extension_enabled(env, uuid) for uuid in SESSION_MODE["enabledExtensions"])

    def _extension_enabled(self, env: dict[str, str], uuid: str) -> bool:
        """The extension (the dock) is enabled: GNOME Shell enables extensions after its start."""
        answer = self._ask(env, "--dest=org.gnome.Shell", "/org/gnome/Shell",
                           "org.gnome.Shell.Extensions.GetExtensionInfo", f"string:{uuid}")
        words = (answer or "").split()
        return any(words[i:i + 4] == ["state", "variant", "double", "1"] for i in range(len(words)))

    def log_tail(self, name: str, chars: int = 600) -> str:
        try:
            text = (self.log_dir / f"gnome-{name}.log").read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return " ".join(text.split()) or "(empty log)"

    def alive(self) -> dict[str, bool]:
        """Which of the session's programs still run (the agent may end them)."""
        return {name: process.poll() is None for name, process in self.processes.items()}
