"""Served prefix-cache hits and TTFT with a shared system prompt: ``vllm serve`` (vLLM's OpenAI server, the
multiprocess engine) with vToken on, sequential streamed completions per mode (``vllm_xargs``), each mode
on its own fresh system prompt so no mode reads another's cache (stand-in until ``vtoken bench serve``).

    python -m vtoken.bench.prefix_served [--requests 6] [--repeats 3] [--out FILE]

Per request: ``usage.prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``) and
TTFT (request sent → first streamed token, client side). Side effects: starts a server on a free port,
stops it at the end; prints one JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


def _post_stream(base: str, body: dict) -> tuple[float, int]:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, cached = None, 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", cached) or cached
    return float(ttft or 0.0), int(cached)


def main(argv: list[str] | None = None) -> None:
    from vtoken.bench.report import environment
    from vtoken.bench.serve_bench import wait_ready
    from vtoken.models.tiny import tiny_model
    from vtoken.serve.launch.local import free_port
    from vtoken.vllm import SCHEDULER_CLS, WORKER_CLS

    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--modes", default="none,repack,reuse+repack")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    port = free_port()
    cfg = {"vtoken": {"policy": "h2o", "budget": 0.3, "mode": "repack", "recent": 16}}
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", str(tiny_model("llama")), "--served-model-name", "tiny",
           "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
           "--scheduler-cls", SCHEDULER_CLS, "--worker-cls", WORKER_CLS, "--additional-config", json.dumps(cfg)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(base, proc, 300, "/health")
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        rng = np.random.default_rng(0)
        runs: dict[str, list] = {m: [] for m in modes}
        _post_stream(base, {"model": "tiny", "prompt": rng.integers(10, 500, 64).tolist(), "max_tokens": 4,
                            "stream": True, "stream_options": {"include_usage": True}})  # warm-up
        for _rep in range(a.repeats):
            for mode in modes:
                system = rng.integers(10, 500, a.system_len).tolist()  # fresh: no mode reads another's cache
                per = []
                for i in range(a.requests):
                    body = {"model": "tiny", "prompt": system + rng.integers(10, 500, a.user_len).tolist(),
                            "max_tokens": a.gen_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True},
                            "vllm_xargs": {"vtoken.mode": mode, "vtoken.salt": 1000 + i}}
                    ttft, cached = _post_stream(base, body)
                    per.append({"cached_tokens": cached, "ttft_s": ttft})
                runs[mode].append(per)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows = []
    for mode in modes:
        later = [r for run in runs[mode] for r in run[1:]]
        rows.append({"mode": mode, "cached_tokens_per_request": [r["cached_tokens"] for r in runs[mode][0]],
                     "hit_rate_after_first": sum(r["cached_tokens"] for r in later)
                     / (len(later) * (a.system_len + a.user_len)),
                     "ttft_p50_s_after_first": statistics.median(r["ttft_s"] for r in later),
                     "ttft_min_s_after_first": min(r["ttft_s"] for r in later)})
    report = {"command": "python -m vtoken.bench.prefix_served " + " ".join(argv or sys.argv[1:]),
              "policy": "h2o", "budget": 0.3, **vars(a), "rows": rows, "runs": runs, "environment": environment()}
    text = json.dumps(report, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
