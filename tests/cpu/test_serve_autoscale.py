"""KV-pressure autoscaling with real engines: 1 → 2 replicas under load, back to 1 when it ends.

Tiny Llama, vToken repack (H2O, budget 0.5), a 40-block KV pool per replica, KVAutoscalingPolicy with
short delays. The load is bounded (at most 6 concurrent requests, stopped at scale-up or after 240 s).
Measured times are printed (-s) and recorded in docs/serving.md.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.launch.local import LocalCluster, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune "


def replica_states(app_name: str, deployment: str) -> dict:
    from ray import serve

    status = serve.status().applications.get(app_name)
    if status is None or deployment not in status.deployments:
        return {}
    return {str(getattr(k, "value", k)): v for k, v in status.deployments[deployment].replica_states.items()}


def running_replicas(app_name: str, deployment: str) -> int:
    return replica_states(app_name, deployment).get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, step_s: float = 0.5) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


def test_kv_pressure_scales_one_to_two_and_back():
    cfg = ServeAppConfig.model_validate(
        {
            "model": "tiny-llama",
            "vtoken": {"mode": "repack", "policy": "h2o", "budget": 0.5},
            "engine": {"kv_cache_blocks": 40, "max_model_len": 1024, "max_num_seqs": 8},
            "limits": {"max_tokens": 700},
            "deployment": {"num_cpus": 0.5, "health_check_period_s": 2.0},
            "autoscaling": {
                "enabled": True,
                "min_replicas": 1,
                "max_replicas": 2,
                "initial_replicas": 1,
                "upscale_kv_utilization": 0.6,
                "downscale_kv_utilization": 0.2,
                "target_kv_utilization": 0.5,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2.0,
                "upscale_delay_s": 1.0,
                "downscale_delay_s": 5.0,
            },
            "router": {"stats_period_s": 0.5},
            "metrics": {"port": None},
        }
    )
    name, dep = cfg.app_name, cfg.deployment.name
    with LocalCluster(http_port=free_port(), num_cpus=2) as cluster:
        cluster.deploy(cfg)
        assert running_replicas(name, dep) == 1
        stop, codes, lock = threading.Event(), [], threading.Lock()

        def load() -> None:
            body = {"model": "tiny-llama", "prompt": PROMPT * 10, "max_tokens": 600, "ignore_eos": True}
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    r = c.post(f"{cluster.url}/v1/completions", json=body)
                    with lock:
                        codes.append(r.status_code)

        threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
        started = time.monotonic()
        for t in threads:
            t.start()
        try:
            decided = wait_for(lambda: sum(replica_states(name, dep).values()) >= 2, timeout_s=240)
            up = wait_for(lambda: running_replicas(name, dep) == 2, timeout_s=240)
        finally:
            stop.set()
            for t in threads:
                t.join(300)
        load_ended = time.monotonic()
        up = None if up is None or decided is None else decided + up
        asked, running = (None if t is None else round(t, 1) for t in (decided, up))
        print(
            f"\n[autoscale] KV pressure: second replica requested {asked} s and running {running} s after "
            f"the load started ({len(codes)} requests, statuses {sorted(set(codes))})"
        )
        assert up is not None, "did not scale up under KV pressure"
        assert set(codes) == {200}
        down = wait_for(lambda: running_replicas(name, dep) == 1, timeout_s=180)
        print(
            f"[autoscale] idle: 2 -> 1 replica {down if down is None else round(down, 1)} s after the load "
            f"ended (load ran {load_ended - started:.0f} s)"
        )
        assert down is not None, "did not scale back down when the load ended"
        r = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200
