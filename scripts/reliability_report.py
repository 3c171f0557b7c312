"""Render the reliability figures recorded by tests/reliability into docs/reliability.md.

    ./workbench reliability          # long variants (ARPO_LONG_TESTS=1), then this script
    python scripts/reliability_report.py [FIGURES_DIR] [OUT]

Only figures of passing tests are recorded (the `figures` fixture in tests/conftest.py), so every number in the
report is from a run in which its test passed.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTIONS = [
    ("test_random_browser_faults_never_become_policy_failures", "1. Environment faults: random kills and hangs",
     "tests/reliability/test_env_faults.py"),
    ("test_a_frozen_browser_times_out_and_its_worker_is_replaced", "1b. A frozen browser is timed out",
     "tests/reliability/test_env_faults.py"),
    ("test_sigkill_at_random_moments_then_resume_continues_exactly[1-process]",
     "2a. Crash-safe runs: SIGKILL and resume, one process", "tests/reliability/test_kill_resume.py"),
    ("test_sigkill_at_random_moments_then_resume_continues_exactly[2-processes]",
     "2b. Crash-safe runs: SIGKILL and resume, two processes (torchrun, FSDP2 on gloo)",
     "tests/reliability/test_kill_resume.py"),
    ("test_one_rank_killed_stops_the_whole_group_and_the_run_resumes_exactly",
     "2c. One rank killed: the group stops, the run resumes", "tests/reliability/test_kill_resume.py"),
    ("test_record_counts", "3. Untrusted model output: parser and pyautogui converter",
     "tests/reliability/test_untrusted_output.py"),
    ("test_a_server_that_accepts_but_never_answers_gives_a_clear_error_in_bounded_time",
     "4a. A server that hangs", "tests/reliability/test_untrusted_input.py"),
    ("test_secrets_in_the_environment_never_reach_run_directories", "4b. Secrets in the environment",
     "tests/reliability/test_untrusted_input.py"),
    ("test_no_credentials_in_tracked_files", "4c. Credentials in tracked files",
     "tests/reliability/test_untrusted_input.py"),
    ("test_soak_no_growth_in_memory_files_or_processes", "5. Soak", "tests/reliability/test_soak.py"),
]


def soak_plot(figures_dir: Path, out: Path) -> bool:
    """Memory and open files over the soak run, as a PNG beside the report."""
    file = figures_dir / "test_soak_no_growth_in_memory_files_or_processes.json"
    if not file.is_file():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(file.read_text())
    pss, fds = data["pss_mb_series"], data["fds_series"]
    episodes = [round(i * data["episodes"] / max(len(pss), 1)) for i in range(len(pss))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    a.plot(episodes, pss, marker=".")
    a.set(title="PSS of the process tree", xlabel="episodes (sampled)", ylabel="MB", ylim=(0, max(pss) * 1.15))
    b.plot(episodes, fds, marker=".", color="tab:orange")
    b.set(title="open file descriptors", xlabel="episodes (sampled)", ylim=(0, max(fds) * 1.15))
    fig.suptitle(f"soak: {data['episodes']} episodes, {data['workers']} browsers ({data['variant']} variant)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return True


def render(figures_dir: Path) -> str:
    lines = ["## Measured figures", "",
             f"Rendered {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} "
             f"({platform.python_version()}) from `{figures_dir.relative_to(REPO) if figures_dir.is_relative_to(REPO) else figures_dir}`.", ""]
    for name, title, path in SECTIONS:
        lines += [f"### {title}", "", f"`{path}::{name}`", ""]
        file = figures_dir / f"{name}.json"
        if not file.is_file():
            lines += ["No figures recorded (the test did not run, or did not pass).", ""]
            continue
        data = json.loads(file.read_text())
        lines += ["| figure | value |", "|---|---|"]
        for key, value in data.items():
            if key in ("test", "trial_log"):
                continue
            lines.append(f"| {key} | {json.dumps(value) if isinstance(value, (dict, list)) else value} |")
        if "trial_log" in data:
            lines += ["", "Kill moments (seconds after start; newest checkpoint and metric lines at that moment):", ""]
            for trial in data["trial_log"]:
                kills = "; ".join(f"{k['at_s']} s ({k['checkpoint'] or 'no checkpoint'}, {k['metric_lines']} lines)"
                                  for k in trial["kills"]) or "finished before the kill"
                lines.append(f"- trial {trial['trial']}: {kills}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    figures_dir = Path(argv[0]) if argv else REPO / "runs" / "reliability"
    out = Path(argv[1]) if len(argv) > 1 else REPO / "docs" / "reliability.md"
    text = out.read_text() if out.is_file() else "# Reliability\n\n<!-- figures -->\n"
    head = text.split("<!-- figures -->")[0]
    body = render(figures_dir.resolve())
    if soak_plot(figures_dir, out.with_name("reliability-soak.png")):
        body += "\n![soak: memory and open files stay flat](reliability-soak.png)\n"
    out.write_text(head + "<!-- figures -->\n" + body)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
