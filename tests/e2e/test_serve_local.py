"""`vtoken serve` (what `make serve` runs): starts on loopback, prints a working URL, curl and openai
example, answers the openai client, and stops cleanly on Ctrl-C with no process left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.serve import LocalServe, wait_for

from vtoken.serve.launch.local import free_port

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


def check_lm_eval_requests(url: str) -> None:
    """The two requests lm-eval 0.4.13's ``local-completions`` sends (docs/quality.md's recipe), verbatim:
    ``generate_until`` (RULER, a list of prompts, stop sequences, a seed) and ``loglikelihood`` (echo with
    logprobs); each answer has the fields its parser reads (``parse_generations``, ``parse_logprobs``)."""
    import httpx

    prompt = "The grass is green. The sky is blue. The sun is"
    gen = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "prompt": [prompt],
            "model": "tiny-llama",
            "max_tokens": 16,
            "temperature": 0,
            "stop": ["</s>"],
            "seed": 1234,
        },
    )
    assert gen.status_code == 200, gen.text
    choices = gen.json()["choices"]
    assert [c["index"] for c in choices] == [0] and isinstance(choices[0]["text"], str)
    ll = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "model": "tiny-llama",
            "prompt": [prompt],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    assert ll.status_code == 200, ll.text
    body = ll.json()
    logprobs, n = body["choices"][0]["logprobs"], body["usage"]["prompt_tokens"]
    assert body["choices"][0]["text"].startswith(prompt)  # echo: the prompt, then the one generated token
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n + 1
    assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
    assert all(isinstance(t, dict) and t for t in logprobs["top_logprobs"][1:])


def test_vtoken_serve_prints_examples_answers_and_stops_cleanly_on_ctrl_c():
    import openai

    port, metrics_port = free_port(), free_port()
    srv = LocalServe(
        port,
        "--model",
        "tiny-llama",
        "--mode",
        "repack",
        "--budget",
        "0.5",
        "--set",
        "engine.kv_cache_blocks=40",
        "--set",
        "engine.max_model_len=1024",
        "--set",
        "limits.max_tokens=256",
        "--set",
        f"metrics.port={metrics_port}",
    )
    with srv:
        banner, url = srv.banner, srv.url
        assert "Ctrl-C to stop." in banner, banner[-3000:]
        assert f"{url}/v1" in banner and "curl -s" in banner and "from openai import OpenAI" in banner
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model="tiny-llama",
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert chat.usage.completion_tokens == 8
        curl = next(line.strip() for line in srv.lines if line.strip().startswith("curl -s"))
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        assert '"chat.completion"' in out.stdout, out.stdout + out.stderr
        snippet = banner.split("python - <<'EOF'\n", 1)[1].split("\n    EOF", 1)[0]
        code = "\n".join(line[4:] for line in snippet.splitlines())
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
        check_lm_eval_requests(url)
    print(f"\n[local] Ctrl-C -> exit {srv.returncode} in {srv.stop_s:.1f} s")
    assert srv.returncode == 0, srv.rest[-3000:]
    assert "stopped." in srv.rest
    assert srv.tmp is not None
    leftovers = processes_mentioning(srv.tmp)
    assert not leftovers, f"processes left behind: {leftovers}"


def test_vtoken_serve_runs_a_hybrid_model_and_its_modes_pair_per_request():
    """A hybrid model (the tiny Gemma 3: sliding-window layers of 64 tokens beside a global layer) behind the
    OpenAI API: the same greedy completion of a 300-token prompt with the replica's repack and, per request,
    naive (``vllm_xargs``) gives the same tokens (the paired oracle, served), the policy evicted, and the
    exporter writes ``vtoken:window_blocks`` with the pool whole again once idle. Prefix caching off: a hit
    would skip the second request's prefill attention over the cached prompt, which H2O's scores sum."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    port, metrics_port = free_port(), free_port()
    # vLLM sizes each of the 4 groups for one max_model_len request (a sliding group for a whole prefill
    # chunk beside its window): 32 + 3 x 33 blocks + the null block = 132 at max_model_len 1024 (pool_need)
    srv = LocalServe(
        port,
        "--model",
        "tiny-gemma3",
        "--mode",
        "repack",
        "--budget",
        "0.3",
        "--set",
        "engine.kv_cache_blocks=160",
        "--set",
        "engine.enable_prefix_caching=false",
        "--set",
        "engine.max_model_len=1024",
        "--set",
        "limits.max_tokens=128",
        "--set",
        f"metrics.port={metrics_port}",
    )
    prompt = " ".join(f"item {i} is number {i * 7 % 13}." for i in range(40))
    with srv:
        assert "Ctrl-C to stop." in srv.banner, srv.banner[-3000:]
        texts = {}
        for mode in ("repack", "naive"):
            r = httpx.post(
                f"{srv.url}/v1/completions",
                timeout=120,
                json={
                    "model": "tiny-gemma3",
                    "prompt": prompt,
                    "max_tokens": 48,
                    "temperature": 0,
                    "ignore_eos": True,
                    "vllm_xargs": {"vtoken.mode": mode},
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] > 200 and body["usage"]["completion_tokens"] == 48
            texts[mode] = body["choices"][0]["text"]
        assert texts["repack"] == texts["naive"]

        def metrics() -> dict | None:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
            out = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
            return out if out.get("vtoken:evicted_tokens_total", 0) > 0 else None

        m = wait_for(metrics, "the replica to report evictions", 60)
        assert m["vtoken:window_blocks"] == 0 and m["vtoken:free_kv_tokens"] == m["vtoken:pool_blocks"] * 32
    assert srv.returncode == 0, srv.rest[-3000:]


@pytest.mark.timeout(120)
def test_vtoken_serve_on_a_busy_port_says_so_and_starts_nothing():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        run = subprocess.run(
            [str(Path(sys.executable).with_name("vtoken")), "serve", "--model", "tiny-llama", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=100,
        )
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"127.0.0.1:{port}" in run.stderr and "in use" in run.stderr and "--port" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr and "starting Ray" not in run.stdout


def test_free_port_stays_out_of_rays_and_the_kernels_port_ranges():
    from vtoken.serve.launch.local import FREE_PORT_RANGE, port_is_free

    lo, hi = FREE_PORT_RANGE
    assert lo > 19999 and hi <= 32768  # Ray workers use 10002-19999; Linux ephemeral ports start at 32768
    picks = [free_port(n=3) for _ in range(20)]
    assert all(lo <= p and p + 3 <= hi for p in picks)
    assert all(port_is_free("127.0.0.1", p + i) for p in picks for i in range(3))
    assert len(set(picks)) > 1  # random start: two callers rarely get the same port


@pytest.mark.timeout(180)
def test_port_lost_between_the_check_and_the_proxy_bind_is_a_clear_error_and_ray_is_stopped(monkeypatch):
    """The race the check cannot close: the port is taken after ``port_is_free`` said yes. Serve's proxy
    fails to bind; LocalCluster must turn that into PortInUseError and leave no Ray running."""
    import socket

    import ray

    from vtoken.serve.launch import local

    assert not ray.is_initialized()  # this test owns the process's Ray for its duration
    port = free_port()
    monkeypatch.setattr(local, "port_is_free", lambda host, p: True)  # the check "misses" the listener
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with (
            pytest.raises(local.PortInUseError, match=f"127.0.0.1:{port}.*in use"),
            local.LocalCluster(http_port=port, num_cpus=1),
        ):
            pass
    assert not ray.is_initialized()
