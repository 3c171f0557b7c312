"""GNOME Settings' panels on the desktop sandbox: which open, and what each asked for that the
sandbox does not run (the system services of a VM's session: NetworkManager, UPower, systemd's
timedated, accountsservice, BlueZ, CUPS, ...).

    python -m arpo_lib.envs.osworld.settings_census [--panels background,power] [--out panels.json]
        [--markdown panels.md] [--screen 1280x800]

Each panel is opened the way a link into Settings opens it (`gnome-control-center PANEL`, what
the desktop's "Display Settings" and "Change Background..." items run), in a fresh GNOME session.
A row says whether a Settings window came up, whether the program was still running after
`SETTLE_S`, how it ended otherwise, and the D-Bus services it asked for and found missing (read
from its own log: "The name X was not provided by any .service files"). The panels OSWorld's
tasks use are `OSWORLD_PANELS`; `PANEL_NOTES` says, for those a VM's services drive, what does not
work here.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

OSWORLD_PANELS = ("background", "notifications", "screen", "power", "display", "keyboard", "sound", "datetime",
                  "universal-access", "default-apps", "bluetooth", "network")
"""What OSWorld's os-domain tasks change on the VM (wallpaper and style, Do Not Disturb, the
automatic screen lock, screen blank, display, keyboard, volume, time format and zone, larger text,
default applications, Bluetooth, the network)."""
PANEL_NOTES = {
    "network": "NetworkManager does not run (the sandbox has no network, or pasta's user-mode one): no connections listed",
    "wifi": "NetworkManager does not run: no Wi-Fi",
    "wwan": "NetworkManager and ModemManager do not run",
    "bluetooth": "BlueZ does not run and there is no adapter: \"No Bluetooth Found\" (OSWorld's Bluetooth task is infeasible on the VM too)",
    "datetime": "Time Format works (a GSettings key); the time zone and the clock are systemd-timedated's, which does not run: greyed out",
    "power": "Screen Blank works (a GSettings key); UPower does not run: no battery, no power mode",
    "user-accounts": "accountsservice does not run: no user listed",
    "printers": "CUPS does not run: no printers",
    "sharing": "systemd does not run: nothing to share",
    "thunderbolt": "boltd does not run",
    "color": "colord does not run: no devices",
    "location": "the portal's permission store does not run",
    "camera": "the portal's permission store does not run",
    "microphone": "the portal's permission store does not run",
}
"""What a panel needs that a VM's session runs and the sandbox does not (checked by hand)."""
SETTLE_S = 4.0
"""How long a panel must keep its window up (and the program running) to count as open."""
WINDOW_TIMEOUT_S = 30.0
MISSING = re.compile(r"The name ([\w.]+) was not provided by any \.service files")


def panels_known(box: Any) -> list[str]:
    """The panels this gnome-control-center offers (`--list`)."""
    listed = box.execute(["gnome-control-center", "--list"], timeout=60)["output"]
    return [line.split()[0] for line in listed.splitlines() if line[:1].isspace() and line.strip()]


def open_panel(box: Any, panel: str) -> dict[str, Any]:
    """Open one panel in a fresh session of `box` (a GNOME Sandbox): its census row."""
    box.reset_session()
    started = time.monotonic()
    box.post_json("/setup/launch", {"command": ["gnome-control-center", panel]})
    window = None
    while time.monotonic() - started < WINDOW_TIMEOUT_S and window is None:
        window = next((w for w in box.windows() if w["wm_class"].startswith("gnome-control-center")), None)
        if window is None:
            time.sleep(0.3)
    opened_s = round(time.monotonic() - started, 1)
    time.sleep(SETTLE_S)
    (app,) = [a for a in box.launched() if a["command"] == ["gnome-control-center", panel]]
    missing = sorted(set(MISSING.findall(app["output"])))
    running = app["returncode"] is None
    if window is not None and running:
        status = "opens"
    elif window is None and running:
        status = "no window"
    else:
        status = f"ended ({app['returncode']})"
    row = {"panel": panel, "status": status, "window_s": opened_s if window is not None else None,
           "missing_services": missing, "note": PANEL_NOTES.get(panel, "")}
    if status != "opens":
        row["output"] = " ".join(app["output"].split())[-400:]
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| panel | OSWorld's tasks | here | services it asked for that do not run | what does not work |",
             "|---|---|---|---|---|"]
    for row in rows:
        services = ", ".join(name.removeprefix("org.freedesktop.") for name in row["missing_services"]) or "-"
        lines.append(f"| {row['panel']} | {'yes' if row['panel'] in OSWORLD_PANELS else ''} | {row['status']} | "
                     f"{services} | {row['note'] or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from desktop_sandbox.sandbox import Sandbox

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--panels", default="", help="comma-separated panel names (default: every panel)")
    parser.add_argument("--out", type=Path, default=Path("settings_panels.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--screen", default="1280x800")
    args = parser.parse_args(argv)
    screen = tuple(int(v) for v in args.screen.lower().split("x"))
    rows = []
    with Sandbox(screen, window_manager="gnome") as box:
        box.reset_session()
        panels = [p for p in args.panels.split(",") if p] or panels_known(box)
        for number, panel in enumerate(panels, 1):
            rows.append(open_panel(box, panel))
            print(f"[{number}/{len(panels)}] {panel}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps({"screen": list(screen), "panels": rows}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
