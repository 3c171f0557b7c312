"""What serving the accessibility tree costs the desktop sandbox: its start and its reset with and
without the episode's buses (a11y.py: a D-Bus session bus and AT-SPI's), and one GET
/accessibility (its latency and the tree's size) with a GTK 3 editor (Mousepad) and with the
browser as OSWorld's tasks start it (`google-chrome --remote-debugging-port=1337`, a local page).

    PYTHONPATH=. python benchmarks/bench_a11y.py [--rounds 5] [--screen 1920x1080]

Writes benchmarks/results/a11y.json. Medians over the rounds (the start over --rounds sandboxes,
the reset over 5 per sandbox, the reading over --rounds readings of the same screen).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arpo_lib.envs.desktop import a11y  # noqa: E402
from desktop_sandbox.sandbox import Sandbox  # noqa: E402
from benchmarks.common import table, write_result  # noqa: E402

PAGE = ("<html><head><title>Local page</title></head><body><h1>A heading</h1>"
        + "".join(f"<p>Paragraph {i} with <a href='#{i}'>a link</a>.</p>" for i in range(20))
        + "<button>Press me</button></body></html>")


def _median_s(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def start_and_reset(screen: tuple[int, int], rounds: int) -> dict[str, Any]:
    starts, resets = [], []
    for _ in range(rounds):
        started = time.monotonic()
        with Sandbox(screen) as box:
            starts.append(time.monotonic() - started)
            for _ in range(5):
                started = time.monotonic()
                box.reset_session()
                resets.append(time.monotonic() - started)
    return {"start_s": _median_s(starts), "reset_s": _median_s(resets)}


def reading(box: Sandbox, rounds: int, ready: Callable[[ET.Element], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while not ready(ET.fromstring(box.accessibility_tree())):
        if time.monotonic() > deadline:
            raise RuntimeError("the application did not appear in the tree within 60 s")
        time.sleep(0.5)
    times, xml = [], ""
    for _ in range(rounds):
        started = time.monotonic()
        xml = box.accessibility_tree()
        times.append(time.monotonic() - started)
    root = ET.fromstring(xml)
    return {"read_s": _median_s(times), "nodes": sum(1 for _ in root.iter()) - 1, "kib": round(len(xml.encode()) / 1024, 1),
            "truncated": root.get("truncated")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--screen", default="1920x1080")
    args = parser.parse_args(argv)
    screen = tuple(int(v) for v in args.screen.lower().split("x"))
    if a11y.unavailable():
        raise SystemExit(f"the accessibility tree cannot be served here: {a11y.unavailable()}")
    result: dict[str, Any] = {"benchmark": "a11y", "command": "PYTHONPATH=. python benchmarks/bench_a11y.py "
                              f"--rounds {args.rounds} --screen {args.screen}",
                              "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
                              "screen": list(screen)}
    result["with_buses"] = start_and_reset(screen, args.rounds)
    served = a11y.unavailable
    a11y.unavailable = lambda: "off for the comparison"  # type: ignore[assignment]
    try:
        result["without_buses"] = start_and_reset(screen, args.rounds)
    finally:
        a11y.unavailable = served  # type: ignore[assignment]
    with Sandbox(screen) as box:
        result["empty"] = reading(box, args.rounds, lambda root: True)
        box.launch(["mousepad"])
        result["mousepad"] = reading(box, args.rounds, lambda root: root.find("application[@name='mousepad']/frame") is not None)
        box.reset_session()
        box.execute(["python3", "-c", "import sys; open('/home/user/page.html', 'w').write(sys.argv[1])", PAGE])
        box.launch(["google-chrome", "--remote-debugging-port=1337", "file:///home/user/page.html"])
        result["chrome"] = reading(box, args.rounds, lambda root: root.find(
            ".//application[@name='Google Chrome']//document-web[@name='Local page']/*") is not None)
    rows = [{"what": "sandbox start, s", "with buses": result["with_buses"]["start_s"],
             "without": result["without_buses"]["start_s"]},
            {"what": "reset, s", "with buses": result["with_buses"]["reset_s"], "without": result["without_buses"]["reset_s"]}]
    print(table(rows, ["what", "with buses", "without"]))
    print(table([{"screen": k, **result[k]} for k in ("empty", "mousepad", "chrome")],
                ["screen", "read_s", "nodes", "kib", "truncated"]))
    path = write_result("a11y", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
