"""How long a reset waits after a task's set-up, before and after it waited for what the set-up
opened ("Reset waits for what the set-up opens, not for a timeout when it opens nothing").

Before: `Sandbox.wait_for_windows(20)`, until at least one window exists and stays the same for 1 s
(20 s when the set-up opens none). Now: `Sandbox.settle(20)`, until the windows are unchanged and the
episode's programs nearly idle for 1 s. Three set-ups, each measured with both waits in one run on
the same sandbox: a command that opens nothing (OSWorld's gsettings tasks), an editor, a browser.

    PYTHONPATH=. python benchmarks/bench_settle.py [--desktop gnome] [--repeats 2]

Writes benchmarks/results/settle.json.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table, write_result  # noqa: E402

SETUPS = {
    "a command, no window": ("execute", "gsettings set org.gnome.desktop.screensaver lock-enabled false || true"),
    "an editor": ("launch", ["mousepad"]),
    "a browser": ("launch", ["google-chrome"]),
}
TIMEOUT_S = 20.0


def measure(box: Any, kind: str, command: Any, wait: str, timeout: float = TIMEOUT_S) -> float:
    box.reset_session()
    if kind == "execute":
        box.execute(command, shell=True)
    else:
        box.launch(command)
    started = time.monotonic()
    if wait == "before":
        box.wait_for_windows(timeout)
    else:
        box.settle(timeout)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from desktop_sandbox.sandbox import Sandbox

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--desktop", default="gnome", choices=("gnome", "openbox"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="both waits' limit (the reset's: 20 s)")
    args = parser.parse_args(argv)
    rows = []
    with Sandbox((1920, 1080), window_manager=args.desktop) as box:
        for name, (kind, command) in SETUPS.items():
            times = {wait: [measure(box, kind, command, wait, args.timeout) for _ in range(args.repeats)]
                     for wait in ("before", "now")}
            rows.append({"set-up": name, "before_s": round(statistics.median(times["before"]), 2),
                         "now_s": round(statistics.median(times["now"]), 2)})
    result = {"benchmark": "settle", "desktop": args.desktop, "repeats": args.repeats, "timeout_s": args.timeout,
              "rows": rows,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": "python benchmarks/bench_settle.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = write_result("settle", result, args.out)
    print(table(rows, ["set-up", "before_s", "now_s"]))
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
