"""`vtoken serve` (what `make serve` runs): starts on loopback, prints a working URL, curl and openai
example, answers the openai client, and stops cleanly on Ctrl-C with no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vtoken.serve.local import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose environment or command line contains ``text`` (the run's private temp dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            blob = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(int(proc.name))
    return found


def test_vtoken_serve_prints_examples_answers_and_stops_cleanly_on_ctrl_c():
    import openai

    port, metrics_port = free_port(), free_port()
    cmd = [
        str(Path(sys.executable).with_name("vtoken")),
        "serve",
        "--model",
        "tiny-llama",
        "--mode",
        "repack",
        "--budget",
        "0.5",
        "--port",
        str(port),
        "--set",
        "engine.kv_cache_blocks=40",
        "--set",
        "engine.max_model_len=1024",
        "--set",
        "limits.max_tokens=256",
        "--set",
        f"metrics.port={metrics_port}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "VTOKEN_API_KEY"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines, tmp = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if tmp is None and (m := re.search(r"temp dir (/tmp/vtr-\w+)", line)):
                tmp = m.group(1)
            if "Ctrl-C to stop." in line:
                break
        banner = "\n".join(lines)
        assert "Ctrl-C to stop." in banner, banner[-3000:]
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in banner and "curl -s" in banner and "from openai import OpenAI" in banner
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model="tiny-llama",
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert chat.usage.completion_tokens == 8
        curl = next(line.strip() for line in lines if line.strip().startswith("curl -s"))
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        assert '"chat.completion"' in out.stdout, out.stdout + out.stderr
        snippet = banner.split("python - <<'EOF'\n", 1)[1].split("\n    EOF", 1)[0]
        code = "\n".join(line[4:] for line in snippet.splitlines())
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
    finally:
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
    print(f"\n[local] Ctrl-C -> exit {proc.returncode} in {time.monotonic() - stopped:.1f} s")
    assert proc.returncode == 0, rest[-3000:]
    assert "stopped." in rest
    assert tmp is not None
    leftovers = processes_mentioning(tmp)
    assert not leftovers, f"processes left behind: {leftovers}"
