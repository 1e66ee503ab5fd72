"""Render vToken's Kubernetes manifests from the checked-in Serve config (pyyaml + stdlib + this checkout).

    python k8s/render.py            # rewrite k8s/rayservice.yaml, podmonitor.yaml, prometheusrule.yaml and
                                    # the TP = 2 variant k8s/variants/rayservice-tp2.yaml
    python k8s/render.py --check    # exit 1 naming the files that differ from what would be rendered
    python k8s/render.py --promtool # promtool check rules + test rules (k8s/tests/rules_test.yaml)

``spec.serveConfigV2`` of the RayService is deploy/serve_config.yaml (the ``serve build`` output) with
exactly two cluster changes, both in ``serve_config_v2`` below and nowhere else:

1. ``metrics.host``/``metrics.port`` merged into the application's ``VTOKEN_SERVE_CONFIG`` (the
   ServeAppConfig JSON the head builds the app from): the replica's Prometheus endpoint must listen on
   the pod IP, not loopback, and on the port the container declares and the PodMonitor scrapes.
2. ``ray_actor_options.num_gpus: 1``: one replica per GPU, so Ray places each replica on a GPU worker
   and the autoscaler adds one GPU pod per replica.

The TP = 2 variant (``variants/rayservice-tp2.yaml``, ``kubectl apply -n vtoken -f`` it instead of the
base RayService; not part of the kustomization) differs in exactly this: the app config also gets
``engine.tensor_parallel_size: 2`` and ``deployment.gpus_per_rank: 1``, and change 2 becomes the
placement-group bundles ``vtoken.serve.launch.app.replica_bundles`` computes for that config (the replica's
own CPU bundle + one ``{CPU: 1, GPU: 1}`` bundle per rank, STRICT_PACK: vLLM's Ray executor places its ranks
there) instead of ``num_gpus``; each GPU worker pod has 2 GPUs (one replica per pod).

The GPU worker group's min/max replicas are the Serve deployment's autoscaling bounds (or its fixed
``num_replicas``). tests/e2e/test_k8s.py checks that the committed files equal this rendering, that
undoing the two changes gives deploy/serve_config.yaml back, and validates everything against the CRDs.

Side effect of importing this file: k8s/ and the repository root go on ``sys.path`` (for k8s/rules.py and
the stdlib-only vtoken/metric_names.py it imports; no other vtoken module is imported, so no installed
vtoken is needed).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

for _path in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
del _path
from rules import METRICS_PORT_NAME, SCRAPE_JOB, prometheus_rule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
OUT = Path(__file__).resolve().parent

NAME = "vtoken"
LABELS = {"app.kubernetes.io/name": "vtoken", "app.kubernetes.io/part-of": "vtoken"}
REPLICA_COMPONENT = "replica"  # pod label app.kubernetes.io/component of the GPU workers
RAY_VERSION = "2.60.0"  # = the ray[serve] pin of pyproject's serve extra (checked by the test)
IMAGE = "vtoken"  # kustomization.yaml `images:` sets registry and tag
APP_DIR = "/opt/vtoken"  # serve_app.py and the baked model cache in the image (k8s/Dockerfile)
CONFIG_ENV = "VTOKEN_SERVE_CONFIG"
PROXY_CALLBACK = "vtoken.serve.control.failover:proxy_middlewares"  # named in deploy/serve_config.yaml
# the replica's prometheus_client server (vtoken/serve/telemetry/metrics.py), local rank 0
METRICS_PORT = 9500
CLUSTER_APP_CONFIG = {"metrics": {"host": "0.0.0.0", "port": METRICS_PORT}}
REPLICA_GPUS = 1
TP_VARIANTS = (2,)  # tensor-parallel sizes rendered as variants/rayservice-tp<N>.yaml

HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
WORKER_RESOURCES = {
    "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
    "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
}
# (name, port): Ray GCS, dashboard (KubeRay submits serveConfigV2 through it), Ray client, Serve HTTP
# (proxy on every node), Ray's own metrics export (KubeRay's default); vToken metrics on workers only.
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("serve", 8000), ("metrics", 8080))
WORKER_PORTS = (("serve", 8000), ("metrics", 8080), (METRICS_PORT_NAME, METRICS_PORT))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _deep_merge(out[key], value) if nested else value
    return out


def serve_config_v2(base: dict, tp: int = 1) -> dict:
    """deploy/serve_config.yaml (parsed) with the two cluster changes of the module docstring (pure); with
    ``tp > 1`` the TP variant's."""
    doc = copy.deepcopy(base)
    extra = (
        CLUSTER_APP_CONFIG
        if tp == 1
        else _deep_merge(
            CLUSTER_APP_CONFIG, {"engine": {"tensor_parallel_size": tp}, "deployment": {"gpus_per_rank": REPLICA_GPUS}}
        )
    )
    for app in doc["applications"]:
        env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env[CONFIG_ENV] = json.dumps(
            _deep_merge(json.loads(env.get(CONFIG_ENV, "{}")), extra), sort_keys=True, separators=(",", ":")
        )
        for dep in app["deployments"]:
            actor = dep.setdefault("ray_actor_options", {})
            if tp == 1:
                actor["num_gpus"] = REPLICA_GPUS
            else:  # = vtoken.serve.launch.app.replica_bundles for the merged config (checked by the test)
                rank = {"CPU": 1.0, "GPU": float(REPLICA_GPUS)}
                dep["placement_group_bundles"] = [{"CPU": float(actor.get("num_cpus", 1))}] + [
                    dict(rank) for _ in range(tp)
                ]
                dep["placement_group_strategy"] = "STRICT_PACK"
    return doc


def replica_bounds(serve_doc: dict) -> tuple[int, int, int]:
    """(min, initial, max) GPU workers = Serve replicas summed over deployments (one GPU each)."""
    lo = start = hi = 0
    for app in serve_doc["applications"]:
        for dep in app["deployments"]:
            auto = dep.get("autoscaling_config")
            if auto:
                lo += auto["min_replicas"]
                start += auto.get("initial_replicas") or auto["min_replicas"]
                hi += auto["max_replicas"]
            else:
                n = dep.get("num_replicas", 1)
                lo, start, hi = lo + n, start + n, hi + n
    return lo, start, hi


def _container(name: str, image: str, ports, resources: dict) -> dict:
    env = [
        {"name": "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "value": PROXY_CALLBACK},
        {"name": "PYTHONPATH", "value": APP_DIR},  # serve_app:app is imported on the head and workers
        {"name": "VTOKEN_CACHE_DIR", "value": f"{APP_DIR}/cache"},  # model converted at image build
        {
            "name": "VTOKEN_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "vtoken-api-key", "key": "key", "optional": True}},
        },
    ]
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
        "resources": copy.deepcopy(resources),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _pod(component: str, container: dict, shm: str, gpu: bool) -> dict:
    spec = {
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}],
    }
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": {**LABELS, "app.kubernetes.io/component": component}}, "spec": spec}


def _scaled(resources: dict, tp: int) -> dict:
    """Worker pod resources for ``tp`` GPUs per pod (CPU, memory and GPUs times ``tp``; pure)."""
    out = copy.deepcopy(resources)
    for part in out.values():
        for key, value in part.items():
            num = "".join(ch for ch in value if ch.isdigit())
            part[key] = str(int(num) * tp) + value[len(num) :]
    return out


def rayservice(serve_text: str, version: str, tp: int = 1) -> dict:
    base = yaml.safe_load(serve_text)
    serve = serve_config_v2(base, tp)
    lo, start, hi = replica_bounds(serve)
    image = f"{IMAGE}:{version}"
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},  # no replica on the head
        "template": _pod("head", _container("ray-head", image, HEAD_PORTS, HEAD_RESOURCES), "2Gi", False),
    }
    worker = {
        "groupName": "gpu",
        "replicas": start,
        "minReplicas": lo,
        "maxReplicas": hi,
        "rayStartParams": {},
        "template": _pod(
            REPLICA_COMPONENT, _container("ray-worker", image, WORKER_PORTS, _scaled(WORKER_RESOURCES, tp)), "8Gi", True
        ),
    }
    header = "".join(line + "\n" for line in serve_text.splitlines() if line.startswith("#"))
    header += (
        "# Rendered by k8s/render.py: + metrics host/port in VTOKEN_SERVE_CONFIG, + num_gpus/replica.\n"
        if tp == 1
        else f"# Rendered by k8s/render.py: TP = {tp} variant (metrics host/port, "
        f"engine.tensor_parallel_size, placement-group bundles of {tp} GPUs per replica).\n"
    )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": NAME if tp == 1 else f"{NAME}-tp{tp}", "labels": dict(LABELS)},
        "spec": {
            "serveConfigV2": header + yaml.safe_dump(serve, sort_keys=False, width=100),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": 60,
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "512Mi"},
                        "limits": {"cpu": "500m", "memory": "512Mi"},
                    },
                },
                "headGroupSpec": head,
                "workerGroupSpecs": [worker],
            },
        },
    }


def pod_monitor() -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": NAME, "labels": dict(LABELS)},
        "spec": {
            "selector": {
                "matchLabels": {
                    "app.kubernetes.io/name": LABELS["app.kubernetes.io/name"],
                    "app.kubernetes.io/component": REPLICA_COMPONENT,
                }
            },
            "podMetricsEndpoints": [
                {
                    "port": METRICS_PORT_NAME,
                    "path": "/metrics",
                    "interval": "15s",
                    "scrapeTimeout": "10s",
                    "relabelings": [{"action": "replace", "targetLabel": "job", "replacement": SCRAPE_JOB}],
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def dump(obj: dict, source: str) -> str:
    return f"# Generated by k8s/render.py from {source}; do not edit.\n" + yaml.dump(
        obj, Dumper=_Dumper, sort_keys=False, width=1000
    )


def render() -> dict[str, str]:
    """File name (in k8s/) -> text (pure apart from reading deploy/serve_config.yaml and pyproject)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return {
        "rayservice.yaml": dump(rayservice(SERVE_CONFIG.read_text(), version), "deploy/serve_config.yaml"),
        "podmonitor.yaml": dump(pod_monitor(), "k8s/render.py"),
        "prometheusrule.yaml": dump(prometheus_rule(NAME, LABELS), "k8s/rules.py"),
    }


def render_variants() -> dict[str, str]:
    """The TP variants outside the kustomization: path (in k8s/) -> text (pure apart from reading)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return {
        f"variants/rayservice-tp{tp}.yaml": dump(
            rayservice(SERVE_CONFIG.read_text(), version, tp), "deploy/serve_config.yaml"
        )
        for tp in TP_VARIANTS
    }


def run_promtool(workdir: Path) -> list[subprocess.CompletedProcess]:
    """Write the alert groups as a plain rule file next to a copy of k8s/tests/rules_test.yaml in
    ``workdir``, then run ``promtool check rules`` and ``promtool test rules`` there (raises
    FileNotFoundError if promtool is not installed: Debian package ``prometheus``)."""
    rules = prometheus_rule(NAME, LABELS)["spec"]
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False, width=1000))
    shutil.copy(OUT / "tests" / "rules_test.yaml", workdir / "rules_test.yaml")
    return [
        subprocess.run(["promtool", *cmd], cwd=workdir, capture_output=True, text=True)
        for cmd in (["check", "rules", "rules.yaml"], ["test", "rules", "rules_test.yaml"])
    ]


def main(argv: list[str]) -> int:
    if "--promtool" in argv:
        with tempfile.TemporaryDirectory() as tmp:
            runs = run_promtool(Path(tmp))
        for run in runs:
            print(" ".join(run.args), "->", run.returncode, "\n", run.stdout, run.stderr, sep="")
        return max(run.returncode for run in runs)
    files = {**render(), **render_variants()}
    stale = [n for n, text in files.items() if not (OUT / n).is_file() or (OUT / n).read_text() != text]
    if "--check" in argv:
        if stale:
            print(f"out of date (run python k8s/render.py): {', '.join(stale)}", file=sys.stderr)
        return 1 if stale else 0
    for name, text in files.items():
        (OUT / name).parent.mkdir(parents=True, exist_ok=True)
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(files)} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
