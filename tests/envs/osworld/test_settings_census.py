"""GNOME Settings' panels on the desktop sandbox (arpo_lib/envs/osworld/settings_census.py): the
panels OSWorld's tasks use open in a fresh session, and what each asked for that the sandbox does
not run is read from its own log."""
from __future__ import annotations

import shutil

import pytest

from arpo_lib.envs.osworld import settings_census
from desktop_sandbox import gnome
from desktop_sandbox.sandbox import Sandbox, desktop_unavailable

REASON = desktop_unavailable() or gnome.unavailable() or (
    None if shutil.which("gnome-control-center") else "GNOME Settings is not installed (./workbench setup installs it)")


def test_the_table_names_each_panels_missing_services_and_what_does_not_work():
    rows = [{"panel": "power", "status": "opens", "missing_services": ["org.freedesktop.UPower"],
             "note": settings_census.PANEL_NOTES["power"]},
            {"panel": "mouse", "status": "ended (-6)", "missing_services": [], "note": ""}]
    table = settings_census.markdown(rows).splitlines()
    assert table[2] == f"| power | yes | opens | UPower | {settings_census.PANEL_NOTES['power']} |"
    assert table[3] == "| mouse |  | ended (-6) | - | - |"


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_the_panels_osworlds_tasks_use_open_and_say_what_they_miss():
    """Screen Blank (Power), the time format (Date & Time) and the wallpaper (Background) open as
    links into Settings open them; Power asked for UPower and Date & Time for systemd's timedated,
    neither of which runs here, and the census says so."""
    with Sandbox((1280, 800), window_manager="gnome") as box:
        box.reset_session()
        assert {"background", "power", "datetime", "network"} <= set(settings_census.panels_known(box))
        rows = {panel: settings_census.open_panel(box, panel) for panel in ("background", "power", "datetime")}
    assert all(row["status"] == "opens" for row in rows.values()), rows
    assert "org.freedesktop.UPower" in rows["power"]["missing_services"], rows["power"]
    assert "org.freedesktop.timedate1" in rows["datetime"]["missing_services"], rows["datetime"]
    assert rows["background"]["missing_services"] == [], rows["background"]
