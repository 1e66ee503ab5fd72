"""``vtoken bench soak``: the served stack under a long mixed run with faults; everything accounted for.

One run (side effects: starts a private Ray + Serve on loopback with ``replicas`` vToken replicas of the tiny
model on a small KV pool, sends requests, SIGKILLs one replica's process mid-run, stops everything)::

    t = 0                     clients start: ``concurrency`` threads, requests drawn from the seed
                              (soak_client.draw: shared system prompts, n 1-2, streaming or not, greedy or
                              sampled, per-request policy and mode, client aborts)
    t = kill_at x duration    one replica's process is SIGKILLed while it runs requests; Serve restarts it
    t = duration              clients stop drawing; in-flight requests finish (or time out: unaccounted)
    then                      wait until every replica is idle; read each replica's counters: its idle KV
                              invariant check ran and found nothing (vLLM's pool: every block
                              unreferenced and counted free) and it holds no block (vtoken:held_blocks = 0)
                              stop the cluster; no engine process may be left
                              replay the greedy, completed, mode-none requests on a fresh engine without
                              pressure: same text (eviction outputs depend on preemption and cache hits, so
                              only the exact-by-construction ones are compared)

The report (``REPORT_KEYS``) has the exact counts per outcome (completed / error / aborted / unaccounted, which
add up to ``requests``), per kind, the invariant and block readings per replica, the replay and the processes
left, and the preemptions each replica counted (polled every 5 s during the run, so the killed replica's
count before its death is kept; the pool pressure is real only if some happened); ``passed`` is the
conjunction of the checks, each listed in ``checks``.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

from vtoken import metric_names as mn
from vtoken.bench.report import command_line
from vtoken.bench.served.measures import ReplicaMetrics
from vtoken.bench.served.soak_client import COMPLETED, OUTCOMES, UNACCOUNTED, Outcome, SoakRequest, draw, send

MAX_MODEL_LEN = 1024  # longest request: ≈ 350 prompt tokens + max_tokens 400; the pool needs > 32 blocks of 32
RUNNING, WAITING = mn.NUM_REQUESTS_RUNNING.name, mn.NUM_REQUESTS_WAITING.name
HELD, CHECKS, VIOLATIONS = mn.HELD_BLOCKS.name, mn.INVARIANT_CHECKS.total, mn.INVARIANT_VIOLATIONS.total
SERVED = mn.REQUESTS.total  # a replica that served nothing has never gone idle after a request: no check due
PREEMPTIONS = mn.NUM_PREEMPTIONS.total

REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "setup",
        "requests",
        "outcomes",
        "by_kind",
        "unaccounted",
        "killed_replica",
        "preemptions",
        "replicas",
        "replay",
        "processes_left",
        "checks",
        "passed",
        "seconds",
    }
)


@dataclass(frozen=True)
class SoakSetup:
    duration_s: float = 120.0
    concurrency: int = 6
    seed: int = 0
    replicas: int = 2
    pool_blocks: int = 64  # small: long requests meet preemption
    max_tokens: int = 400
    abort_rate: float = 0.15
    kill_at: float = 0.4  # share of the duration at which one replica is killed (0: no kill)
    policies: tuple[str, ...] = ("h2o", "tova", "scissorhands", "snapkv", "streamingllm", "knorm", "random")
    modes: tuple[str, ...] = ("repack", "reuse+repack", "naive", "none")
    request_timeout_s: float = 180.0
    replay_max: int = 24


def app_config(setup: SoakSetup, metrics_port: int):
    from vtoken.serve.config import ServeAppConfig

    return ServeAppConfig.model_validate(
        {
            "model": "tiny-llama",
            "vtoken": {"mode": "repack", "policy": "h2o", "budget": 0.5, "sinks": 4, "recent": 16, "scope": "all"},
            "engine": {"kv_cache_blocks": setup.pool_blocks, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8},
            "limits": {"max_tokens": 800, "max_n": 2, "max_prompt_chars": 8000, "max_body_bytes": 65536},
            "deployment": {"num_replicas": setup.replicas, "num_cpus": 0.5, "health_check_period_s": 2.0},
            "router": {"stats_period_s": 0.5, "stale_after_s": 3.0},
            "metrics": {"port": metrics_port, "port_span": 4},
        }
    )


def scrape(metrics_port: int, span: int, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``{replica: {series: value}}`` from every replica metrics endpoint in the port range (one replica per
    endpoint; each value summed over the series' label sets by ``ReplicaMetrics.sample``; a series the replica
    does not export is left out)."""
    import httpx

    out: dict[str, dict[str, float]] = {}
    for port in range(metrics_port, metrics_port + span):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        replica = re.search(r'replica="([^"]+)"', text)
        if replica:
            values = {name: ReplicaMetrics.sample(text, name) for name in names}
            out[replica.group(1)] = {name: v for name, v in values.items() if v is not None}
    return out


def _idle(row: dict[str, float]) -> bool:
    """A replica with nothing running or waiting that checked its KV invariants since its last request (a
    replica that served nothing yet, e.g. the one Serve started after the kill, has nothing to check)."""
    return (
        row.get(RUNNING, 1) == 0 and row.get(WAITING, 1) == 0 and (row.get(CHECKS, 0) >= 1 or row.get(SERVED, 0) == 0)
    )


def _running(cfg) -> int:
    from ray import serve

    app = serve.status().applications.get(cfg.app_name)
    dep = app.deployments.get(cfg.deployment.name) if app else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def _kill_busy_replica(cfg, metrics_port: int, span: int, deadline: float) -> str | None:
    """SIGKILL the process of the first replica seen running a request (polling its metrics endpoint every
    0.5 s until ``deadline``: a kill under load, not of an idle replica); its id, or None if none was busy."""
    import os
    import signal

    import ray

    from vtoken.serve.launch import procs

    def busy() -> str | None:
        return next((r for r, row in scrape(metrics_port, span, (RUNNING,)).items() if row.get(RUNNING, 0) >= 1), None)

    try:
        replica = procs.wait_for(busy, "a replica running a request", max(deadline - time.monotonic(), 0.0), 0.5)
    except TimeoutError:
        return None
    handle = ray.get_actor(f"SERVE_REPLICA::{cfg.app_name}#{cfg.deployment.name}#{replica}", namespace="serve")
    pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return replica


def _replay(setup: SoakSetup, sent: dict[int, SoakRequest], outcomes: list[Outcome]) -> dict:
    """Greedy, completed, mode-none, n = 1 requests again on a fresh in-process engine, one by one."""
    import tempfile

    from vllm import SamplingParams

    from vtoken.models.tiny import tiny_model
    from vtoken.vllm.offline.launch import start_engine

    chosen = [
        o
        for o in outcomes
        if o.outcome == COMPLETED
        and sent[o.index].greedy
        and sent[o.index].body["vllm_xargs"]["vtoken.mode"] == "none"
        and sent[o.index].body["n"] == 1
    ]
    chosen = chosen[: setup.replay_max]
    if not chosen:
        return {"compared": 0, "mismatches": []}
    with tempfile.TemporaryDirectory(prefix="vtoken-soak-") as tmp:
        llm = start_engine(str(tiny_model("llama")), 32, tmp, max_model_len=MAX_MODEL_LEN, check=True)
        mismatches = []
        for o in chosen:
            b = sent[o.index].body
            p = SamplingParams(
                max_tokens=b["max_tokens"],
                temperature=0.0,
                ignore_eos=b["ignore_eos"],
                extra_args={"vtoken": {"mode": "none"}},
            )
            text = llm.generate([b["prompt"]], [p], use_tqdm=False)[0].outputs[0].text
            if text != o.texts[0]:
                mismatches.append({"index": o.index, "served": o.texts[0][:120], "replayed": text[:120]})
        llm.llm_engine.engine_core.shutdown()
    return {"compared": len(chosen), "mismatches": mismatches}


def run_soak(setup: SoakSetup, on_phase=lambda text: None) -> dict:
    import httpx

    from vtoken.serve.launch import procs
    from vtoken.serve.launch.local import LocalCluster, free_port

    start = time.monotonic()
    metrics_port, span = free_port(n=16), 16
    cfg = app_config(setup, metrics_port)
    engines_before = {pid for pid, _, _ in procs.snapshot() if procs.is_engine(pid)}
    sent: dict[int, SoakRequest] = {}
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = itertools.count()
    with LocalCluster(http_port=free_port(), num_cpus=2) as cluster:
        on_phase(f"deploying {setup.replicas} replicas")
        cluster.deploy(cfg)
        url = f"{cluster.url}/v1/completions"
        t0 = time.monotonic()
        stop_at = t0 + setup.duration_s

        def client() -> None:
            with httpx.Client() as c:
                while time.monotonic() < stop_at:
                    with lock:
                        i = next(counter)
                    req = draw(
                        i, setup.seed, "tiny-llama", setup.policies, setup.modes, setup.abort_rate, setup.max_tokens
                    )
                    with lock:
                        sent[i] = req
                    out = send(c, url, req, setup.request_timeout_s)
                    with lock:
                        outcomes.append(out)

        on_phase(f"soaking for {setup.duration_s:g} s")
        killed, preempted = None, Counter()  # replica -> the highest preemption count it reported

        def poll_preemptions(futures, until: float) -> None:
            """Scrape every 5 s until ``until`` or until every client is done, whichever comes first."""
            while (left := until - time.monotonic()) > 0:
                for replica, row in scrape(metrics_port, span, (PREEMPTIONS,)).items():
                    preempted[replica] = max(preempted[replica], int(row.get(PREEMPTIONS, 0)))
                if not wait(futures, timeout=min(5.0, left)).not_done:
                    return

        with ThreadPoolExecutor(setup.concurrency) as pool:
            futures = [pool.submit(client) for _ in range(setup.concurrency)]
            if setup.kill_at > 0:
                poll_preemptions(futures, t0 + setup.kill_at * setup.duration_s)
                killed = _kill_busy_replica(cfg, metrics_port, span, stop_at)
            poll_preemptions(futures, float("inf"))
            for f in futures:
                f.result()
        on_phase("waiting for Serve to run every replica again and for them to go idle")
        names = (RUNNING, WAITING, HELD, CHECKS, VIOLATIONS, SERVED)

        def settled() -> dict[str, dict[str, float]] | None:
            rows = scrape(metrics_port, span, names)
            ok = len(rows) >= setup.replicas and _running(cfg) >= setup.replicas and all(map(_idle, rows.values()))
            return rows if ok else None

        try:
            rows = procs.wait_for(settled, "every replica running and idle", 600, 1.0)
        except TimeoutError:  # reported: the checks below fail on what the replicas say now
            rows = scrape(metrics_port, span, names)
    on_phase("checking processes and replaying greedy requests")
    left = [
        pid
        for pid in procs.alive(pid for pid, _, _ in procs.snapshot() if procs.is_engine(pid))
        if pid not in engines_before
    ]
    replay = _replay(setup, sent, outcomes)
    tally = Counter(o.outcome for o in outcomes)
    kinds = Counter(
        (("stream" if sent[o.index].body["stream"] else "plain") + f"/n{sent[o.index].body['n']}", o.outcome)
        for o in outcomes
    )
    checks = {
        "every request accounted for": tally.get(UNACCOUNTED, 0) == 0 and sum(tally.values()) == len(sent),
        "requests completed": tally.get(COMPLETED, 0) > 0,
        "the pool forced preemptions": sum(preempted.values()) > 0,
        "a replica was killed": killed is not None or setup.kill_at == 0,
        "every replica idle and checked": len(rows) >= setup.replicas and all(map(_idle, rows.values())),
        # the idle check covers vLLM's own pool: every block unreferenced and counted free, nothing leaked
        "no KV invariant violation": all(r.get(VIOLATIONS, 1) == 0 for r in rows.values()),
        "no block held when idle": all(r.get(HELD, 1) == 0 for r in rows.values()),
        "no engine process left": not left,
        "greedy replay equal": not replay["mismatches"],
    }
    return {
        "bench": "soak",
        "command": command_line(),
        "setup": asdict(setup),
        "requests": len(sent),
        "outcomes": {k: tally.get(k, 0) for k in OUTCOMES},
        "by_kind": {f"{k}:{o}": n for (k, o), n in sorted(kinds.items())},
        "unaccounted": [asdict(o) for o in outcomes if o.outcome == UNACCOUNTED][:20],
        "killed_replica": killed,
        "preemptions": {"total": sum(preempted.values()), "by_replica": dict(preempted)},
        "replicas": rows,
        "replay": replay,
        "processes_left": left,
        "checks": checks,
        "passed": all(checks.values()),
        "seconds": round(time.monotonic() - start, 1),
    }
