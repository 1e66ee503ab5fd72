"""The Serve app on a multi-node Ray cluster on this machine: ``python -m vtoken.serve.launch.cluster``
(``make cluster-up``) starts a head and three worker nodes with ``ray start``, and the YAML goes in with
``serve deploy`` as KubeRay hands it over — built by the same ``serve_build_yaml`` as
deploy/serve_config.yaml, for the tiny model, small pools, one replica per node, KV autoscaling 1 → 2.

In order (one cluster for the module; ≈4–6 min on 2 busy cores): KV load makes the autoscaler add a
replica on another node; both answer through the head's proxy with distinct ``x-vtoken-node``; the
KV-aware router steers by the replicas' KV across nodes; a real Prometheus finds both through the
registry's file_sd file (no target list); a worker node is SIGKILLed under load — every request gets 200
or 503, none hangs, Serve brings the replica back on the spare node and Prometheus shows the dip; a
shorter ``downscale_delay_s`` through ``serve deploy`` restarts nothing, and idle, Serve goes back to one
replica (the project's only scale-down test with real replicas). The cluster is always torn down and no
process may be left. Numbers are printed (-s) and in docs/serving.md.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from support.ops import load_module
from support.paths import ROOT
from support.serve import PrometheusServer, wait_for

from vtoken.bench.served.measures import ReplicaMetrics
from vtoken.serve.config import ServeAppConfig
from vtoken.serve.launch import procs
from vtoken.serve.launch.cluster import ClusterState
from vtoken.serve.launch.deploy import serve_build_yaml
from vtoken.serve.launch.local import free_port
from vtoken.serve.telemetry.discovery import SD_FILENAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune "
LONG_TOKENS = 6400  # the router test's long generations: ≈1570 + 6400 ≤ max_model_len 8160
STATS_PERIOD_S = 0.5  # router.stats_period_s: how often Serve polls each replica's routing stats
CLUSTER = [sys.executable, "-m", "vtoken.serve.launch.cluster"]
build = load_module(ROOT / "dashboards" / "build.py")


def app_config(metrics_port: int) -> ServeAppConfig:
    return ServeAppConfig.model_validate(
        {
            "model": "tiny-llama",
            "vtoken": {"mode": "repack", "policy": "h2o", "budget": 0.5, "sinks": 4, "recent": 16, "scope": "all"},
            "engine": {"kv_cache_blocks": 256, "max_model_len": 8160, "max_num_seqs": 8},  # (256 - 1) · 32
            "limits": {"max_tokens": LONG_TOKENS, "max_prompt_chars": 8000},
            "deployment": {"max_replicas_per_node": 1, "health_check_period_s": 2.0},
            "autoscaling": {
                "enabled": True,
                "min_replicas": 1,
                "max_replicas": 2,
                "upscale_kv_utilization": 0.3,
                "downscale_kv_utilization": 0.01,
                "target_kv_utilization": 0.3,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2.0,
                "upscale_delay_s": 1.0,
                "downscale_delay_s": 3600.0,
            },
            "router": {"stats_period_s": STATS_PERIOD_S, "stale_after_s": 3.0},
            "metrics": {"port": metrics_port, "port_span": 3, "port_wait_s": 1.0},
        }
    )


def run(*args: str, timeout: float = 600) -> str:
    out = subprocess.run([*CLUSTER, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"cluster {args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def cluster(request):
    state_dir = Path(tempfile.mkdtemp(prefix="vtm-", dir="/tmp"))
    http_port = free_port()
    started = time.monotonic()
    try:
        run("up", "--workers", "3", "--state", str(state_dir))
        up_s = time.monotonic() - started
        doc = yaml.safe_load(serve_build_yaml(app_config(free_port(n=4))))
        doc["http_options"] = {"host": "127.0.0.1", "port": http_port}  # a free port; loopback
        config = state_dir / "serve.yaml"
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        run("deploy", str(config), "--state", str(state_dir), "--timeout", "400")
        state = ClusterState.load(state_dir)
        print(
            f"\n[multinode] 4 nodes up in {up_s:.0f} s, app RUNNING {time.monotonic() - started:.0f} s after the start"
        )
        sd_file = state_dir / "ray" / SD_FILENAME  # the registry's default: next to Ray's own SD file
        with (
            PrometheusServer([], port=free_port(), sd_files=[str(sd_file)]) as prom,
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as http,
        ):
            yield SimpleNamespace(
                state=state,
                http=http,
                prom=prom,
                sd_file=sd_file,
                t0=time.time(),
                names={n.node_id: n.name for n in state.nodes},
                config=config,
            )
    finally:
        if request.session.testsfailed:  # keep Ray's and the nodes' logs for the diagnosis
            kept = Path(tempfile.mkdtemp(prefix="vtoken-multinode-logs-", dir="/tmp"))
            for log in state_dir.glob("*.log"):
                shutil.copy(log, kept)
            for session in (state_dir / "ray").glob("session_2*"):
                shutil.copytree(session / "logs", kept / session.name, dirs_exist_ok=True)
            print(f"[multinode] logs kept in {kept}")
        saved = (state_dir / "cluster.json").exists()
        groups = [n.pgid for n in ClusterState.load(state_dir).nodes] if saved else []
        down = subprocess.run(
            [*CLUSTER, "down", "--state", str(state_dir)], capture_output=True, text=True, timeout=180
        )
        left = procs.cluster_pids(state_dir, groups)
        print(f"[multinode] down: {down.stdout.strip()} (exit {down.returncode}); left: {sorted(left)}")
        assert down.returncode == 0 and not left, f"processes left after down: {sorted(left)}"


def complete(http: httpx.Client, max_tokens: int = 4, prompt: str = "hello", **extra) -> httpx.Response:
    return http.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, **extra}
    )


def nodes_answering(http: httpx.Client, tries: int = 24, header: str = "x-vtoken-node") -> Counter:
    """Answers per node (or per replica, with ``header="x-vtoken-replica"``) over ``tries`` requests."""
    return Counter(complete(http).headers[header] for _ in range(tries))


def all_answering(c, count: int, header: str = "x-vtoken-node", timeout: float = 60.0) -> Counter:
    """``nodes_answering`` until ``count`` distinct nodes (replicas) have answered, or fail. One sample is
    not proof that only one serves: the KV router sends every request to one replica while the other's
    stats are stale (its ``record_routing_stats`` answered Serve's poll > 2 s late while it streamed a
    long generation: seen), so a test that read the serving nodes off one sample once killed the wrong
    node."""
    seen: Counter = Counter()

    def grown():
        seen.update(nodes_answering(c.http, 6, header))
        return len(seen) >= count and seen

    return wait_for(
        grown,
        f"{count} distinct {header} answering",
        timeout,
        1.0,
        lambda: f"answers so far: {dict(seen)}\n{diagnosis(c)}",
    )


def registered(c) -> dict[str, str]:
    """``{replica id: node id}`` as the metrics registry lists them (the cluster's record of placement)."""
    return {
        g["labels"]["__meta_vtoken_replica"]: g["labels"]["__meta_vtoken_node"]
        for g in json.loads(c.sd_file.read_text())
    }


def serve_replicas(c) -> dict:
    """Serve's replica states of the app (``serve status`` on the head, the CLI KubeRay also reads)."""
    serve_cli = str(Path(sys.executable).with_name("serve"))
    out = subprocess.run(
        [serve_cli, "status", "--address", c.state.dashboard], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    app = yaml.safe_load(out)["applications"]["vtoken"]
    return app["deployments"]["VTokenReplica"].get("replica_states") or {}


def diagnosis(c) -> str:
    """``serve status``, every replica's KV numbers as it exports them, the router's "ranked last" lines
    (proxy logs) and the end of the Serve controller's log, for a failure message."""
    serve_cli = str(Path(sys.executable).with_name("serve"))
    status = subprocess.run(
        [serve_cli, "status", "--address", c.state.dashboard], capture_output=True, text=True, timeout=60
    ).stdout
    serve_logs = sorted(Path(c.state.state_dir, "ray").glob("session_2*/logs/serve/*.log"))  # not _latest
    router = [
        line
        for log in serve_logs
        if log.name.startswith("proxy_")
        for line in log.read_text(errors="replace").splitlines()
        if "vtoken router" in line
    ]
    controller = [log for log in serve_logs if log.name.startswith("controller_")]
    tail = controller[-1].read_text()[-4000:] if controller else "(no controller log)"
    return (
        f"serve status:\n{status}\nreplicas (exported):\n{replica_view(c)}\nrouter, ranked last "
        f"({len(router)} lines):\n" + "\n".join(router[-10:]) + f"\ncontroller log (end):\n{tail}"
    )


EXPORTED = (
    "vtoken:free_kv_tokens",
    "vtoken:held_blocks",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vtoken:routing_stats_polls_total",
)


def exported(c) -> dict[str, dict[str, float | str | None]]:
    """``{node name: {metric: value}}`` for ``EXPORTED``, read now from each registered replica's metrics
    endpoint (``None``: not exported; ``{"error": ...}`` for a replica that does not answer)."""
    out: dict[str, dict[str, float | str | None]] = {}
    for group in json.loads(c.sd_file.read_text()):
        node = c.names.get(group["labels"].get("__meta_vtoken_node", ""), "?")
        try:
            text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=10).text
            out[node] = {name: ReplicaMetrics.sample(text, name) for name in EXPORTED}
        except httpx.HTTPError as exc:
            out[node] = {"error": repr(exc)}
    return out


def replica_view(c) -> str:
    """Each registered replica's node and the KV/queue numbers its metrics endpoint exports right now."""
    try:
        return "\n".join(f"  {node}: {values}" for node, values in exported(c).items()) or "  (registry empty)"
    except (OSError, ValueError) as exc:
        return f"  (no registry file: {exc!r})"


def test_kv_autoscaling_adds_a_replica_on_another_node_and_both_answer_through_one_proxy(cluster):
    c = cluster
    (first,) = nodes_answering(c.http, 4)  # min_replicas 1: one replica, on one worker node
    assert c.names[first].startswith("worker-")
    stop, codes, errors = threading.Event(), Counter(), []

    def pressure():  # long generations on a 256-block pool: mean kv_utilization over the 0.3 threshold
        while not stop.is_set():  # two of them hold 2 · 0.5 · (2240 + t) tokens: 0.27 → 0.64 of the pool
            r = complete(c.http, max_tokens=3000, prompt=PROMPT * 80, ignore_eos=True)
            codes[r.status_code] += 1
            if r.status_code != 200:
                errors.append(f"{r.status_code} {dict(r.headers)} {r.text[:500]}")

    threads = [threading.Thread(target=pressure, daemon=True) for _ in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    try:  # the load only has to make Serve decide; the new replica then starts on a quieter machine
        wait_for(
            lambda: sum(serve_replicas(c).values()) >= 2,
            "Serve to add a replica",
            400,
            2.0,
            diagnose=lambda: diagnosis(c),
        )
        decided = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    both = wait_for(
        lambda: len(n := nodes_answering(c.http, 6)) == 2 and n,
        "a second replica",
        400,
        2.0,
        diagnose=lambda: diagnosis(c),
    )
    print(
        f"\n[multinode] KV load → Serve adds a replica after {decided:.0f} s, serving after "
        f"{time.monotonic() - started:.0f} s; nodes {sorted(c.names[n] for n in both)}; "
        f"load answers {dict(codes)}"
    )
    assert set(codes) == {200}, errors[:3]
    spread = nodes_answering(c.http, 30)
    assert len(spread) == 2 and all(c.names[n].startswith("worker-") for n in spread), spread
    r = c.http.get("/ready")
    assert r.json()["node"] == r.headers["x-vtoken-node"]


def test_router_ranks_replicas_across_nodes_by_free_kv(cluster):
    """One long generation on each node (queues equal, 1 and 1), one of them with a long prompt: short
    requests go to the node with more free KV — Serve's power of two would split them. The long prompt
    (≈1570 tokens: ≈785 held at budget 0.5) puts the gap three queued requests' charges
    (``tokens_per_queued_request`` 256) above ``tie_tokens``: Serve's queue-length cache may still count a
    short request that has finished. With a gap one charge above (784 tokens, 700 generated on 48 blocks)
    a host under load sent 2/4 to the wrong node, and once in CI the first generation (3.1 s here) ended
    before the second was routed. The tiny model's speed varies with the load (2400 tokens: from < 4 s
    on a quiet host to > 20 s beside busy loops), so both generate up to ``LONG_TOKENS`` and the client
    closes them once the short requests are done (Serve aborts them in vLLM); rounds of the pair run until
    ``SHORTS`` short requests were answered while both generations ran, at most ``ROUNDS``."""
    c = cluster
    all_answering(c, 2)  # the two replicas the autoscaling test above adds (the module is one scenario)
    targets: Counter = Counter()  # over the rounds: shorts to the free node ("free") or the long one's
    rounds = 0
    while targets.total() < SHORTS and rounds < ROUNDS:
        rounds += 1
        free_node, long_node, shorts, idle_s = router_round(c)
        targets.update({"free": shorts[free_node], "long": shorts[long_node]})
        print(
            f"\n[multinode] router across nodes, round {rounds}: {shorts[free_node]}/{shorts.total()} short "
            f"requests to the node with more free KV ({c.names[free_node]}; long prompt on "
            f"{c.names[long_node]}); both idle {idle_s:.1f} s after the client closed the streams"
        )
    n = targets.total()
    assert n >= 6, f"only {n} short requests answered while both long generations ran\n{diagnosis(c)}"
    assert targets["free"] / n >= 0.8, f"{dict(targets)}\n{diagnosis(c)}"


SHORTS, ROUNDS = 20, 3


def polls_after(c, extra: int) -> None:
    """Wait until Serve has taken every registered replica's routing stats ``extra`` more times (each
    replica counts them in ``vtoken:routing_stats_polls_total``): the router then ranks on stats taken
    after everything that happened before the call. A counter, not a sleep: under load the polls run late."""

    def polls() -> dict[str, float]:
        return {node: v.get("vtoken:routing_stats_polls_total") or 0.0 for node, v in exported(c).items()}

    start = polls()
    wait_for(
        lambda: all(polls().get(node, 0.0) >= n + extra for node, n in start.items()),
        f"{extra} routing-stats polls of every replica",
        60,
        STATS_PERIOD_S / 2,
        lambda: diagnosis(c),
    )


def router_round(c) -> tuple[str, str, Counter, float]:
    """Start the long-prompt generation, let four stats polls pass, start the short-prompt one (it must go
    to the other node), then send up to ``SHORTS`` short requests one by one while both run; close both
    streams and wait until neither replica runs a request. Returns (the short-prompt generation's node, the
    long prompt's node, answers per node, seconds from closing the streams to both replicas idle)."""
    holders: dict[str, str] = {}
    codes: dict[str, int] = {}
    started = {k: threading.Event() for k in ("big", "small")}
    done = threading.Event()  # set when either long generation ends: from then on queues differ
    finish = threading.Event()  # the client closes both streams

    def generate(key: str, prompt: str) -> None:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
        try:
            with c.http.stream("POST", "/v1/completions", json=body, timeout=600) as r:
                holders[key], codes[key] = r.headers["x-vtoken-node"], r.status_code
                started[key].set()
                for _ in r.iter_lines():
                    if finish.is_set():
                        break
        finally:
            done.set()

    threads = [threading.Thread(target=generate, args=("big", PROMPT * 56), daemon=True)]
    threads[0].start()
    try:
        assert started["big"].wait(120) and codes["big"] == 200, codes
        polls_after(c, 4)  # four stats polls of each replica: the router sees the big request's blocks
        threads.append(threading.Thread(target=generate, args=("small", "hi"), daemon=True))
        threads[1].start()
        assert started["small"].wait(120) and codes["small"] == 200, codes
        assert not done.is_set(), "the long-prompt generation ended before the second one was routed"
        assert holders["big"] != holders["small"], (
            f"the short-prompt generation went to the long prompt's node ({c.names[holders['big']]})\n{diagnosis(c)}"
        )
        # four more: the router sees the second generation running (until then Serve's queue counts it
        # as queued, charged ``tokens_per_queued_request``); the router's copy of the stats cannot be read
        # from here, so the wait is on each replica's count of the polls that took its stats
        polls_after(c, 4)
        shorts: Counter = Counter()
        for _ in range(SHORTS):  # only answers routed while both long generations still run count
            node = complete(c.http, max_tokens=2).headers["x-vtoken-node"]
            if done.is_set():
                break
            shorts[node] += 1
    finally:
        finish.set()
        closed = time.monotonic()
        for t in threads:
            t.join(120)
    wait_for(
        lambda: all(v.get("vllm:num_requests_running") == 0 for v in exported(c).values()),
        "both replicas idle after the client closed its streams",
        300,
        0.5,
        lambda: diagnosis(c),
    )
    return holders["small"], holders["big"], shorts, time.monotonic() - closed


def test_prometheus_finds_every_replica_on_every_node_through_the_registry(cluster):
    c = cluster
    groups = json.loads(c.sd_file.read_text())
    assert len(groups) == 2 and len({g["labels"]["__meta_vtoken_node"] for g in groups}) == 2

    def scraped():
        result = c.prom.query("count by (node) (vtoken:kv_utilization)")
        return result if len(result) == 2 else None

    per_node = wait_for(scraped, "Prometheus to scrape both replicas", 60, 1.0)
    assert {s["metric"]["node"] for s in per_node} == {g["labels"]["__meta_vtoken_node"] for g in groups}
    assert {s["metric"]["node"] for s in per_node} <= set(c.names) - {c.state.node("head").node_id}
    up = c.prom.query('up{job="vtoken"}')
    assert sorted(float(s["value"][1]) for s in up) == [1.0, 1.0], up


def test_worker_node_killed_under_load_gets_200_or_503_and_serve_restores_it_elsewhere(cluster):
    c = cluster
    serving = set(registered(c).values())
    assert len(serving) == 2 and set(all_answering(c, 2)) == serving, registered(c)
    victim = c.names[min(serving)]
    spare = next(n.name for n in c.state.nodes[1:] if n.node_id not in serving)
    spare_id = c.state.node(spare).node_id
    results: list[tuple[float, float, object, str | None]] = []
    stop, errors = threading.Event(), []

    def load():  # short completions, 2 clients, through the head's proxy (light: a replica must start
        # on these 2 cores meanwhile — at one request per 0.2 s per client it took 2–4 min, idle ≈ 30 s)
        with httpx.Client(base_url=str(c.http.base_url), timeout=90) as http:
            while not stop.wait(1.0):
                t = time.monotonic()
                try:
                    r = complete(http, max_tokens=16, prompt=PROMPT)
                    results.append((t, time.monotonic(), r.status_code, r.headers.get("x-vtoken-node")))
                    if r.status_code not in (200, 503):
                        errors.append(f"{r.status_code} {r.text[:300]}")
                except httpx.HTTPError as exc:
                    results.append((t, time.monotonic(), type(exc).__name__, None))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    killed_at, killed_wall = time.monotonic(), time.time()
    out = run("kill-node", victim, "--state", c.state.state_dir)
    try:
        back = wait_for(
            lambda: next((r for r in results if r[3] == spare_id and r[0] > killed_at), None),
            f"a replica on {spare}",
            700,
            1.0,
            lambda: diagnosis(c),
        )
        recovered_s = back[1] - killed_at
        # 4-6 s after the replacement's first answer here. In CI once not within 60 s: the test had read the
        # serving nodes off one routed sample and taken the other replica's node for the spare, so "back"
        # was immediate and this waited on the real replacement (``all_answering``)
        wait_for(
            lambda: serve_replicas(c).get("RUNNING") == 2, "Serve: 2 replicas RUNNING", 120, 1.0, lambda: diagnosis(c)
        )
        both_s = time.monotonic() - killed_at
        time.sleep(4.0)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    after = [r for r in results if r[0] >= killed_at - 1.0]
    outcomes = Counter(r[2] for r in after)
    slowest = max(r[1] - r[0] for r in results)
    print(
        f"\n[multinode] {out.strip()}; requests sent from 1 s before the kill: {dict(outcomes)}, slowest "
        f"{slowest:.1f} s; replica back on {spare} {recovered_s:.1f} s after the kill, Serve: 2 RUNNING "
        f"after {both_s:.1f} s"
    )
    assert set(outcomes) <= {200, 503}, (outcomes, errors[:3])  # no connection error, timeout (= hang)
    assert slowest < 90
    assert set(all_answering(c, 2)) == serving - {c.state.node(victim).node_id} | {spare_id}
    # the dashboard's "Replicas per node" query (all nodes) over the run: 2, fewer while the node is gone, 2
    (expr,) = [
        build.concrete(e)
        for t, e in build.panel_queries(build.kv_dashboard())
        if t == "Replicas per node" and "by (node)" not in e
    ]
    series = c.prom.query_range(expr, killed_wall - 15, time.time(), 1.0)
    counts = [int(float(v)) for _, v in series[0]["values"]]
    print(f"[multinode] Prometheus {expr} over the run: {compress(counts)}")
    # one sample per second from 15 s before the kill; a lone 1 is a slow scrape (seen at load 30), a run
    # of them is the lost node: 2 before the kill, ≥ 3 s of 1 after it, then 2 again
    before, after = ",".join(map(str, counts[:15])), ",".join(map(str, counts[15:]))
    assert "2,2" in before and "1,1,1" in after, counts
    assert "2,2,2" in after[after.index("1,1,1") :], counts


def test_an_autoscaling_update_through_serve_deploy_keeps_the_replicas_and_idle_scales_to_one(cluster):
    """An operator shortens ``downscale_delay_s`` in the deployed YAML (as in KubeRay's serveConfigV2) and
    runs ``serve deploy`` again: a lightweight update (Serve reconfigures, restarts nothing); with no load
    the KV policy then asks for ``min_replicas`` and Serve stops one replica; the registry drops it."""
    c = cluster
    before = all_answering(c, 2, "x-vtoken-replica")  # the two replicas the node-kill test left
    doc = yaml.safe_load(c.config.read_text())
    doc["applications"][0]["deployments"][0]["autoscaling_config"]["downscale_delay_s"] = 5.0
    shorter = Path(c.state.state_dir) / "serve-short-downscale.yaml"
    shorter.write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.monotonic()
    run("deploy", str(shorter), "--state", c.state.state_dir, "--timeout", "120")
    wait_for(
        lambda: serve_replicas(c) == {"RUNNING": 1},
        "Serve to stop the idle second replica",
        120,
        1.0,
        diagnose=lambda: diagnosis(c),
    )
    down_s = time.monotonic() - started
    after = nodes_answering(c.http, 8, "x-vtoken-replica")
    assert len(after) == 1 and set(after) <= set(before), (before, after)  # kept, not restarted
    left = wait_for(
        lambda: len(g := json.loads(c.sd_file.read_text())) == 1 and g,
        "the registry to drop the stopped replica",
        30,
        1.0,
    )
    print(
        f"\n[multinode] downscale_delay_s 3600 -> 5 by serve deploy: 2 -> 1 replica {down_s:.0f} s after "
        f"the deploy; the registry lists {len(left)} endpoint"
    )


def test_ray_stop_force_on_a_node_leaves_no_engine_process_behind(cluster):
    """``ray stop --force`` on a node (Ray's processes SIGKILLed, the vLLM engines its replica started left
    alone, as the real command leaves them): the engines exit on their own within ``ENGINE_EXIT_BOUND_S``
    (issue 29; vtoken/vllm/lifetime.py). Checked by process. Last in the module: it takes a node away."""
    c = cluster
    node_id = sorted(set(registered(c).values()))[0]  # after the downscale test: its one replica's node
    victim = c.names[node_id]
    killed_at = time.monotonic()
    out = run("stop-ray", victim, "--state", c.state.state_dir)
    engines = json.loads(out.rsplit("engine processes left ", 1)[1])
    assert len(engines) >= 2, out  # VLLM::EngineCore and its VLLM::Worker, alive when Ray went away
    wait_for(
        lambda: not procs.alive(engines),
        "the engine processes of the stopped node to exit",
        ENGINE_EXIT_BOUND_S,
        0.2,
        diagnose=lambda: f"still alive: {sorted(procs.alive(engines))}",
    )
    print(f"\n[multinode] {out.strip()}; all gone {time.monotonic() - killed_at:.1f} s after Ray was stopped")


ENGINE_EXIT_BOUND_S = 20.0  # lifetime.py: a 1 s poll, SIGTERM (vLLM's shutdown), os._exit 5 s later


def compress(values: list[int]) -> str:
    """``[2, 2, 1, 1, 1, 2]`` → ``2×2 1×3 2×1`` (the run-length form printed for the docs)."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return " ".join(f"{v}×{n}" for v, n in out)
