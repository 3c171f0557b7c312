"""OSWorld's computer in the sandbox (desktop_sandbox/gnome.py): GNOME Shell with Ubuntu's
look and the VM's shortcuts, driven the way an agent drives it (pyautogui through the checked
action channel), reset to the same desktop after whatever the agent did to it."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import time

import pytest
from PIL import Image

from desktop_sandbox import gnome
from desktop_sandbox.confinement import HOSTNAME
from desktop_sandbox.sandbox import Sandbox, desktop_unavailable

REASON = desktop_unavailable() or gnome.unavailable()
SCREEN = (1280, 800)


# ---- without a sandbox ---------------------------------------------------------------------------

@pytest.mark.skipif(gnome.unavailable() is not None, reason=gnome.unavailable() or "")
def test_the_session_files_carry_ubuntus_settings_below_the_users(tmp_path):
    """The dconf database is a file-db below the user's (what the agent sets wins, `reset` goes
    back to Ubuntu's values); the session mode enables Ubuntu's dock; the session bus starts no
    indexer and no service from the home."""
    root = gnome.write_session_files(tmp_path, "/inside")
    assert (root / "dconf-profile").read_text() == "user-db:user\nfile-db:/inside/gnome/ubuntu.db\n"
    mode = json.loads((root / "data" / "gnome-shell" / "modes" / "ubuntu.json").read_text())
    assert mode["enabledExtensions"] == ["dash-to-dock@micxgx.gmail.com"]
    assert mode["stylesheetName"] == "Yaru/gnome-shell.css"
    profile = tmp_path / "profile"
    profile.write_text(f"file-db:{root / 'ubuntu.db'}\n")
    env = {"DCONF_PROFILE": str(profile), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    read = subprocess.run(["dconf", "read", "/org/gnome/shell/favorite-apps"], env=env, capture_output=True,
                          text=True, check=True).stdout
    assert read.startswith("['google-chrome.desktop', 'thunderbird.desktop', 'code.desktop'")
    binding = subprocess.run(["dconf", "read", "/org/gnome/settings-daemon/plugins/media-keys/custom-keybindings/"
                              "terminal/binding"], env=env, capture_output=True, text=True, check=True).stdout
    assert binding.strip() == "'<Primary><Alt>t'"
    services = {p.name for p in (root / "services").iterdir()}
    assert "org.gnome.Terminal.service" in services and "org.gnome.Nautilus.service" in services
    assert not any(name.startswith(("org.freedesktop.Tracker3", "org.gnome.evolution")) for name in services)
    if (gnome.APPLICATIONS / "st.desktop").is_file():  # the openbox desktop's terminal: not in the VM's grid
        assert "NoDisplay=true" in (root / "data" / "applications" / "st.desktop").read_text()
    if (gnome.APPLICATIONS / gnome.TEXT_EDITOR).is_file():
        editor = (root / "data" / "applications" / gnome.TEXT_EDITOR).read_text()
        assert "\nName=Text Editor\n" in editor and "\nName=gedit\n" not in editor and "Name=New Window" in editor
        assert "text/plain=org.gnome.gedit.desktop" in (root / "config" / "gnome-mimeapps.list").read_text()
    bus = (root / "session-bus.conf").read_text()
    assert "<servicedir>/inside/gnome/services</servicedir>" in bus and "standard_session_servicedirs" not in bus


def test_gnome_unavailable_names_the_packages(monkeypatch):
    gnome.unavailable.cache_clear()
    monkeypatch.setattr(gnome.shutil, "which", lambda name: None)
    try:
        reason = gnome.unavailable()
        assert reason is not None and "gnome-shell" in reason and "./workbench setup" in reason
    finally:
        gnome.unavailable.cache_clear()


# ---- the desktop ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def box():
    if REASON:
        pytest.skip(REASON)
    sandbox = Sandbox(SCREEN, window_manager="gnome")
    yield sandbox
    sandbox.close()


def wait_for_window(box, part: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for window in box.windows():
            if part in window["title"]:
                return window["title"]
        time.sleep(0.2)
    raise AssertionError(f"no window titled with {part!r} within {timeout} s: {box.windows()}")


def act(box, code: str) -> None:
    done = box.run_action(code)
    assert done["returncode"] == 0, done


def typed(box, text: str) -> None:
    act(box, f"pyautogui.write({text!r}, interval=0.01)\npyautogui.press('enter')")


def wait_for_file(box, path: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while (data := box.read_file(path)) is None:
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.2)
    time.sleep(0.3)  # the shell may still be writing it
    return (box.read_file(path) or data).decode(errors="replace")


@pytest.mark.slow
def test_the_screen_at_reset_is_ubuntus_desktop(box):
    """Top bar (dark, the clock in its middle), the dock on the left, the wallpaper's colours
    elsewhere; the VM's settings read back through gsettings inside; no window open."""
    box.reset_session()

    deadline = time.monotonic() + 20  # on a loaded machine the shell draws its panels a moment late
    while True:
        shot = Image.open(io.BytesIO(box.screenshot())).convert("RGB")
        top_bar = shot.getpixel((SCREEN[0] // 3, 8))
        dock = shot.getpixel((4, SCREEN[1] * 9 // 10))  # the dock's background, below its icons
        wallpaper = shot.getpixel((SCREEN[0] // 2, SCREEN[1] // 2))
        if (dock != wallpaper and wallpaper[0] > 100) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert max(top_bar) < 60, f"the top bar is dark on Ubuntu: {top_bar}"
    assert dock != wallpaper and max(dock) < 120, f"the dock is a dark strip on the left: {dock} vs {wallpaper}"
    assert wallpaper[0] > 100 and wallpaper[2] > 60, f"Ubuntu's orange-to-aubergine background: {wallpaper}"
    assert box.windows() == []
    said = box.execute("gsettings get org.gnome.shell.extensions.dash-to-dock dock-position; "
                       "gsettings get org.gnome.desktop.interface gtk-theme; hostname; id -un; echo $HOME; "
                       "echo $DBUS_SESSION_BUS_ADDRESS; ls /var/lib/dpkg/status", shell=True)
    assert said["output"].split() == ["'LEFT'", "'Yaru'", HOSTNAME, "user", "/home/user",
                                      "unix:path=/run/user/1000/bus", "/var/lib/dpkg/status"], said


@pytest.mark.slow
def test_ctrl_alt_t_opens_gnome_terminal_titled_as_on_the_vm(box):
    """The first key chord after the session starts works (the server taps a key once: mutter
    drops the first event of the XTEST keyboard), and the terminal's title is the VM's."""
    box.reset_session()
    act(box, "pyautogui.hotkey('ctrl', 'alt', 't')")
    title = wait_for_window(box, "@")
    assert title == f"user@{HOSTNAME}: ~"
    typed(box, "echo $TERM $XDG_CURRENT_DESKTOP > ~/Desktop/shell.txt")
    assert wait_for_file(box, "~/Desktop/shell.txt").split() == ["xterm-256color", "ubuntu:GNOME"]
    out = box.get_json("/terminal")["output"]
    from desktop_sandbox import a11y

    if a11y.unavailable() is None:  # the tree is read where python3-pyatspi is installed
        assert "shell.txt" in out
    box.post_json("/setup/launch", {"command": ["gnome-control-center"]})
    wait_for_window(box, "Settings", timeout=30)
    time.sleep(1.0)
    assert box.get_json("/terminal")["output"] is None  # a terminal without the focus is not OSWorld's terminal


@pytest.mark.slow
def test_super_opens_the_overview_and_alt_f2_the_run_dialog(box):
    box.reset_session()
    act(box, "pyautogui.press('winleft')")
    time.sleep(1.0)
    overview = box.execute(["gdbus", "call", "--session", "-d", "org.gnome.Shell", "-o", "/org/gnome/Shell",
                            "-m", "org.freedesktop.DBus.Properties.Get", "org.gnome.Shell", "OverviewActive"])
    assert "true" in overview["output"], overview
    act(box, "pyautogui.press('esc')")
    act(box, "pyautogui.hotkey('alt', 'f2')")
    time.sleep(1.0)
    act(box, "pyautogui.write('gnome-terminal', interval=0.01)\npyautogui.press('enter')")
    assert wait_for_window(box, "@").startswith("user@")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gnome-control-center") is None, reason="GNOME Settings is not installed "
                    "(./workbench setup installs it)")
def test_settings_opens_from_the_overview_and_its_appearance_panel_works_by_clicks(box):
    """GNOME Settings, found as on the VM: Super, type "settings", Enter. Its Appearance panel,
    driven by a click on the Dark style, sets what OSWorld's checkers read (gsettings)."""
    box.reset_session()
    act(box, "pyautogui.press('winleft')")
    time.sleep(1.5)
    act(box, "pyautogui.write('settings', interval=0.05)")
    time.sleep(1.5)
    act(box, "pyautogui.press('enter')")
    assert wait_for_window(box, "Settings", timeout=30) == "Settings"
    box.reset_session()
    box.post_json("/setup/launch", {"command": ["gnome-control-center", "background"]})
    wait_for_window(box, "Settings", timeout=30)
    time.sleep(2.0)
    act(box, "pyautogui.click(910, 268)")  # the Dark style's picture (1280x800, the window centred)
    deadline = time.monotonic() + 10
    while (scheme := box.execute("gsettings get org.gnome.desktop.interface color-scheme", shell=True)["output"].strip()) \
            != "'prefer-dark'" and time.monotonic() < deadline:
        time.sleep(0.3)
    assert scheme == "'prefer-dark'"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gnome-control-center") is None, reason="GNOME Settings is not installed "
                    "(./workbench setup installs it)")
def test_settings_opens_from_the_desktops_menu_and_the_system_menu_as_on_the_vm(box):
    """The desktop's right-click menu (Change Background..., Display Settings, Settings) and the
    system menu's gear open GNOME Settings, on the panel each names (Settings remembers its last
    panel in GSettings)."""
    def last_panel() -> str:
        return box.execute("gsettings get org.gnome.Settings last-panel", shell=True)["output"].strip()

    for item, point, panel in (("Display Settings", (729, 579), "'display'"),
                               ("Change Background...", (749, 531), "'background'"),
                               ("Settings", (704, 614), None)):
        box.reset_session()
        act(box, "pyautogui.rightClick(640, 500)")  # the bare desktop (1280x800): the menu opens below the pointer
        time.sleep(1.5)
        act(box, f"pyautogui.click{point}")
        assert wait_for_window(box, "Settings", timeout=30) == "Settings", item
        if panel is not None:
            deadline = time.monotonic() + 10
            while last_panel() != panel and time.monotonic() < deadline:
                time.sleep(0.3)
            assert last_panel() == panel, item
    box.reset_session()
    act(box, "pyautogui.click(1240, 12)")  # the system menu, top right
    time.sleep(1.5)
    act(box, "pyautogui.click(963, 71)")  # its gear
    assert wait_for_window(box, "Settings", timeout=30) == "Settings"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gedit") is None, reason="gedit is not installed (./workbench setup installs it)")
def test_the_text_editor_is_the_vms_gedit_from_the_overview_and_for_text_files(box):
    """"Text Editor" in the overview opens gedit, and a text file opens in it with the window
    title OSWorld's set-ups wait for ("restaurants.txt (~/Desktop) - gedit")."""
    box.reset_session()
    act(box, "pyautogui.press('winleft')")
    time.sleep(1.5)
    act(box, "pyautogui.write('text editor', interval=0.05)")
    time.sleep(1.5)
    act(box, "pyautogui.press('enter')")
    assert wait_for_window(box, " - gedit", timeout=30)  # gedit is titled "gedit" a moment before its document
    box.reset_session()
    box.execute("printf 'a list\\n' > ~/Desktop/restaurants.txt", shell=True)
    box.post_json("/setup/open_file", {"path": "/home/user/Desktop/restaurants.txt", "timeout": 60})
    assert wait_for_window(box, "restaurants.txt (~/Desktop) - gedit", timeout=30) == "restaurants.txt (~/Desktop) - gedit"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("soffice") is None, reason="LibreOffice is not installed (setup-desktop --osworld)")
def test_libreoffice_starts_as_on_the_vm_without_first_run_dialogs(box):
    """With the profile the OSWorld provider writes into every fresh home, Writer opens its
    document with no Tip of the Day (it took the first typed text) and Impress without its template
    chooser, as on OSWorld's VM image, whose LibreOffice has been run before."""
    from desktop_sandbox.osworld import HOME_PROFILES

    box.reset_session()
    (script,) = [script for program, script in HOME_PROFILES if program == "soffice"]
    assert box.execute(script, shell=True)["returncode"] == 0
    for app, title in (("--writer", "Untitled 1 - LibreOffice Writer"), ("--impress", "Untitled 2 - LibreOffice Impress")):
        box.post_json("/setup/launch", {"command": ["soffice", app]})
        wait_for_window(box, title, timeout=60)
        time.sleep(4.0)  # the dialogs open a moment after the document's window
        titles = [w["title"] for w in box.windows()]
        assert not any(t.startswith(("Tip of the Day", "Select a Template")) for t in titles), titles


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("soffice") is None, reason="LibreOffice is not installed (setup-desktop --osworld)")
def test_calc_save_as_with_a_typed_xlsx_name_writes_an_excel_file_without_a_format_question(box):
    """Save As as an agent on the VM does it: Ctrl+Shift+S, the name typed with its extension over
    the selected "Untitled 1", nothing else picked, Enter. With the VM's profile (Excel the format
    Calc saves in) the dialog starts on Excel 2007-365 and LibreOffice asks no "Keep current
    format?" question: ~/Documents/prices.xlsx is an Excel workbook. The document's window opens
    maximised, as on the VM."""
    import zipfile

    from desktop_sandbox.osworld import HOME_PROFILES

    box.reset_session()
    (script,) = [script for program, script in HOME_PROFILES if program == "soffice"]
    assert box.execute(script, shell=True)["returncode"] == 0
    box.post_json("/setup/launch", {"command": ["soffice", "--calc"]})
    wait_for_window(box, "Untitled 1 - LibreOffice Calc", timeout=60)
    (calc,) = [w for w in box.windows() if w["title"] == "Untitled 1 - LibreOffice Calc"]
    probe = ("from Xlib import display; d = display.Display(); w = d.create_resource_object('window', "
             f"{calc['id']}); p = w.get_full_property(d.intern_atom('_NET_WM_STATE'), 0); "
             "print(*[d.get_atom_name(a) for a in (p.value if p else [])])")
    state = box.execute(["python3", "-c", probe])["output"].split()
    assert {"_NET_WM_STATE_MAXIMIZED_HORZ", "_NET_WM_STATE_MAXIMIZED_VERT"} <= set(state), state
    time.sleep(2.0)  # the sheet takes keys a moment after its window is mapped
    typed(box, "42")
    act(box, "pyautogui.hotkey('ctrl', 'shift', 's')")
    wait_for_window(box, "Save")
    time.sleep(1.0)
    act(box, "pyautogui.write('prices.xlsx', interval=0.02)")
    act(box, "pyautogui.press('enter')")
    wait_for_window(box, "prices.xlsx - LibreOffice Calc")  # a format question would hold the save here
    assert "Confirm File Format" not in [w["title"] for w in box.windows()]
    saved = box.execute("find ~ -name 'prices*' -newer ~/.config/libreoffice/4/user/registrymodifications.xcu",
                        shell=True)["output"].split()
    assert saved == ["/home/user/Documents/prices.xlsx"], saved
    with zipfile.ZipFile(io.BytesIO(box.read_file("~/Documents/prices.xlsx"))) as workbook:
        assert "xl/workbook.xml" in workbook.namelist()
        assert "<v>42</v>" in workbook.read("xl/worksheets/sheet1.xml").decode()


@pytest.mark.slow
def test_the_screen_never_blanks_the_x_screensaver_and_dpms_are_off(box):
    """The X server's own screensaver (armed at 600 s by default) and DPMS are off, and stay off
    once GNOME's session is up: an episode that waits through a slow update step sees the screen
    it left, not a blank one scored as the model's failure."""
    box.reset_session()
    probe = ("from Xlib import display; d = display.Display(); "
             "print(d.get_screen_saver().timeout, d.has_extension('DPMS') and d.dpms_info().state)")
    said = box.execute(["python3", "-c", probe])
    assert said["output"].split() in (["0", "False"], ["0", "0"]), said  # DPMS gone, or there and off


@pytest.mark.slow
def test_the_screen_cannot_lock_so_the_lock_probe_is_not_needed_here(box):
    """GNOME Shell offers its lock screen (org.gnome.ScreenSaver) only with GDM, which the sandbox
    has not: Super+L, the VM's lock key, changes nothing, and OSWorld's environment's lock probe,
    run as it runs in a VM, answers False. (On VMs it asks before every action:
    tests/envs/osworld/test_env.py.)"""
    from arpo_lib.envs.osworld.env import LOCK_PROBE

    box.reset_session()
    before = box.screenshot()
    act(box, "pyautogui.hotkey('winleft', 'l')")
    time.sleep(2.0)
    assert box.execute(["python3", "-c", LOCK_PROBE])["output"].strip() == "locked: False"
    owner = box.execute(["gdbus", "call", "--session", "-d", "org.freedesktop.DBus", "-o", "/org/freedesktop/DBus",
                         "-m", "org.freedesktop.DBus.NameHasOwner", "org.gnome.ScreenSaver"])
    assert owner["output"].strip() == "(false,)", owner
    after = Image.open(io.BytesIO(box.screenshot())).convert("RGB")
    centre = (SCREEN[0] // 2, SCREEN[1] // 2)
    assert after.getpixel(centre) == Image.open(io.BytesIO(before)).convert("RGB").getpixel(centre)  # the wallpaper still


@pytest.mark.slow
def test_every_printable_character_the_agent_types_reaches_the_terminal_as_written(box):
    """The converter's code for a type action (`to_pyautogui`), run by the action server into
    GNOME Terminal: every printable ASCII character arrives as typed, `<` included (pyautogui on
    X11 alone types it as `>`: `wc -l < f` would run `wc -l > f`)."""
    from arpo_lib.actions import Action, to_pyautogui

    printable = "".join(chr(c) for c in range(0x20, 0x7f))
    box.reset_session()
    act(box, "pyautogui.hotkey('ctrl', 'alt', 't')")
    wait_for_window(box, "@")
    for text in ("set +H; cat > ~/Desktop/typed.txt <<'END'\n", printable + "\n", "END\n"):  # +H: no `!` expansion
        act(box, to_pyautogui(Action("type", text=text), SCREEN))
    assert wait_for_file(box, "~/Desktop/typed.txt") == printable + "\n"


@pytest.mark.slow
def test_sudo_asks_the_vms_password_at_the_terminal_and_gives_no_privilege(box):
    box.reset_session()
    act(box, "pyautogui.hotkey('ctrl', 'alt', 't')")
    wait_for_window(box, "@")
    typed(box, "sudo id -un > ~/Desktop/who.txt; echo $? > ~/Desktop/rc.txt")
    time.sleep(1.0)
    assert box.read_file("~/Desktop/rc.txt") is None  # waiting at the password prompt
    typed(box, "hunter2")
    assert wait_for_file(box, "~/Desktop/rc.txt").strip() == "1"
    typed(box, "sudo id -un > ~/Desktop/who.txt; echo $? > ~/Desktop/rc2.txt")
    time.sleep(0.5)
    typed(box, "password")
    assert wait_for_file(box, "~/Desktop/rc2.txt").strip() == "0"
    assert wait_for_file(box, "~/Desktop/who.txt").strip() == "user"
    apt = box.execute("echo password | sudo -S apt-get update >/dev/null 2>&1; echo $?; "
                      "echo password | sudo -S apt-get install -y sysstat 2>/dev/null | tail -2; echo $?; "
                      "echo password | sudo -S apt-get install -y no-such-package-here >/dev/null 2>&1; echo $?; "
                      "echo password | sudo -S touch /etc/arpo-test 2>/dev/null; echo $?", shell=True)
    lines = apt["output"].splitlines()
    assert lines[0] == "0" and "already the newest version" in apt["output"] and lines[-2:] == ["100", "1"], apt


@pytest.mark.slow
def test_a_reset_restores_the_desktop_whatever_the_agent_did_to_it(box):
    """Settings changed, an extension of the agent's enabled, the shell and the settings daemon
    killed: the next episode has Ubuntu's desktop again, its shortcut working."""
    box.reset_session()
    act(box, "pyautogui.hotkey('ctrl', 'alt', 't')")
    wait_for_window(box, "@")
    ext = "owned@agent"
    typed(box, f"mkdir -p ~/.local/share/gnome-shell/extensions/{ext} && cd $_ && "
               f"echo '{{\"uuid\": \"{ext}\", \"name\": \"o\", \"description\": \"o\", \"shell-version\": [\"43\"]}}' "
               f"> metadata.json && echo 'function init() {{ return {{enable() {{}}, disable() {{}}}}; }}' > extension.js; "
               f"gsettings set org.gnome.shell enabled-extensions \"['{ext}']\"; "
               "gsettings set org.gnome.settings-daemon.plugins.media-keys custom-keybindings \"[]\"; "
               "gsettings set org.gnome.desktop.interface gtk-theme Adwaita; touch ~/Desktop/done.txt")
    wait_for_file(box, "~/Desktop/done.txt")
    box.execute("pkill -KILL gsd-media-keys; pkill -KILL gnome-shell", shell=True)
    box.reset_session()
    assert box.get_json("/health")["incidents"] == []
    said = box.execute("gsettings get org.gnome.desktop.interface gtk-theme; "
                       "gsettings get org.gnome.shell enabled-extensions; "
                       "ls ~/.local/share/gnome-shell/extensions 2>/dev/null | wc -l", shell=True)["output"].split()
    assert said[0] == "'Yaru'" and said[-1] == "0", said
    act(box, "pyautogui.hotkey('ctrl', 'alt', 't')")
    assert wait_for_window(box, "@") == f"user@{HOSTNAME}: ~"


@pytest.mark.slow
@pytest.mark.skipif(__import__("desktop_sandbox.confinement", fromlist=["x"]).vscode_home() is None,
                    reason="VS Code is not installed (setup-desktop --osworld runs scripts/setup_vscode.sh)")
def test_vs_code_opens_from_the_code_command_and_keeps_its_settings_where_osworld_reads_them(box):
    """OSWorld's vs_code tasks: their set-ups run `code <folder>`, their getters read
    ~/.config/Code/User/settings.json and ask `code --list-extensions`. Inside the sandbox, `code`
    is the staged code-server in an application window titled as VS Code's, its desktop entry is
    the dock's favourite's name, and a setting typed into the settings file is there for the checker."""
    box.reset_session()
    assert box.execute(["code", "--list-extensions"], timeout=120)["returncode"] == 0
    box.execute("mkdir -p ~/project && echo 'print(1)' > ~/project/test.py", shell=True)
    box.post_json("/setup/launch", {"command": ["code", "/home/user/project"]})
    # the workbench has loaded once the title names the folder (window.title: "... - project - Visual Studio Code")
    assert wait_for_window(box, "project - Visual Studio Code", timeout=120).endswith("Visual Studio Code")
    time.sleep(2.0)
    entry = box.execute(["sh", "-c", "cat /opt/arpo/bin/xdg/applications/code.desktop"])["output"]
    assert "Exec=code %F" in entry and "StartupWMClass=Code" in entry
    act(box, "pyautogui.hotkey('ctrl', 'shift', 'p')")
    time.sleep(2.0)
    act(box, "pyautogui.write('Preferences: Open User Settings (JSON)', interval=0.02)")
    time.sleep(2.0)  # the list filters as it is typed
    act(box, "pyautogui.press('enter')")
    time.sleep(4.0)
    act(box, "pyautogui.hotkey('ctrl', 'a')")
    act(box, "pyautogui.write('{\"editor.fontSize\": 18}', interval=0.02)")
    act(box, "pyautogui.hotkey('ctrl', 'shift', 'end')")  # the editor's auto-closed quote and brace after it
    act(box, "pyautogui.press('delete')")
    act(box, "pyautogui.hotkey('ctrl', 's')")
    deadline = time.monotonic() + 30
    while '"editor.fontSize": 18' not in (box.read_file("~/.config/Code/User/settings.json") or b"").decode() \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert json.loads(box.read_file("~/.config/Code/User/settings.json")) == {"editor.fontSize": 18}
