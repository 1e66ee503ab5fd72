"""Offline checks of the Kubernetes manifests (k8s/): rendering in sync with deploy/serve_config.yaml,
validation against the KubeRay and Prometheus Operator CRDs, promtool on the alerts, the image recipe."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from support.ops import exported_names, load_module, promtool, schema_errors, selectors
from support.paths import ROOT

render = load_module(ROOT / "k8s" / "render.py")
rules = load_module(ROOT / "k8s" / "rules.py")
K8S = ROOT / "k8s"
RAYSERVICE, PODMONITOR, RULE = (
    "ray.io_rayservices.yaml",
    "monitoring.coreos.com_podmonitors.yaml",
    "monitoring.coreos.com_prometheusrules.yaml",
)


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def serve_v2() -> dict:
    return yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])


def groups(rs: dict) -> tuple[dict, dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"], worker


def leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, path + (i,))
    else:
        yield path, node


def test_committed_manifests_are_the_rendering_of_deploy_serve_config():
    assert render.main(["--check"]) == 0, "run: python k8s/render.py"
    for name, text in render.render().items():
        assert (K8S / name).read_text() == text, name


def test_serve_config_v2_is_deploy_serve_config_plus_exactly_the_two_cluster_changes():
    from ray.serve.schema import ServeDeploySchema

    from vtoken.serve.config import ServeAppConfig

    base = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    v2 = serve_v2()
    ServeDeploySchema.model_validate(v2)
    flat = dict(leaves(base))
    changed = {p for p, v in leaves(v2) if flat.get(p, object()) != v}
    gpus = ("applications", 0, "deployments", 0, "ray_actor_options", "num_gpus")
    app_env = ("applications", 0, "runtime_env", "env_vars", "VTOKEN_SERVE_CONFIG")
    assert gpus in changed and changed <= {gpus, app_env}
    assert flat.keys() <= {p for p, _ in leaves(v2)}, "a key of deploy/serve_config.yaml was dropped"
    app = v2["applications"][0]
    assert app["deployments"][0]["ray_actor_options"]["num_gpus"] == 1
    cfg = ServeAppConfig.load(app["runtime_env"]["env_vars"]["VTOKEN_SERVE_CONFIG"])  # validates the JSON
    assert cfg.metrics.host == "0.0.0.0" and cfg.metrics.port == render.METRICS_PORT
    _, worker = groups(manifest("rayservice.yaml"))
    ports = {p["name"]: p["containerPort"] for p in worker["template"]["spec"]["containers"][0]["ports"]}
    assert ports[rules.METRICS_PORT_NAME] == cfg.metrics.port and ports["serve"] == v2["http_options"]["port"]


def test_serve_deployment_options_agree_with_the_code_for_the_cluster_config():
    from vtoken.serve.config import ServeAppConfig
    from vtoken.serve.launch.app import deployment_options

    app = serve_v2()["applications"][0]
    (dep,) = app["deployments"]
    opts = deployment_options(ServeAppConfig.load(app["runtime_env"]["env_vars"]["VTOKEN_SERVE_CONFIG"]))
    assert dep["name"] == opts["name"] and dep["max_ongoing_requests"] == opts["max_ongoing_requests"]
    if "autoscaling_config" in opts:
        auto = opts["autoscaling_config"]
        assert (dep["autoscaling_config"]["min_replicas"], dep["autoscaling_config"]["max_replicas"]) == (
            auto.min_replicas,
            auto.max_replicas,
        )
    else:
        assert dep["num_replicas"] == opts["num_replicas"]
    router = dep["request_router_config"]
    assert router["request_router_class"] == opts["request_router_config"].request_router_class


def test_cluster_shape_gpu_workers_autoscaling_and_importable_modules():
    rs = manifest("rayservice.yaml")
    cluster = rs["spec"]["rayClusterConfig"]
    head, worker = groups(rs)
    serve_pin = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
        if d.startswith("ray[")
    )
    import ray

    assert cluster["enableInTreeAutoscaling"] is True
    assert serve_pin.endswith("==" + cluster["rayVersion"]) and ray.__version__ == cluster["rayVersion"]
    assert head["rayStartParams"]["num-cpus"] == "0", "replicas must not land on the head"
    (wc,) = worker["template"]["spec"]["containers"]
    (hc,) = head["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert str(wc["resources"][kind]["nvidia.com/gpu"]) == "1"
        assert "nvidia.com/gpu" not in hc["resources"][kind]
    bounds = (worker["minReplicas"], worker["replicas"], worker["maxReplicas"])
    assert bounds == render.replica_bounds(serve_v2())
    assert hc["image"] == wc["image"], "router/policy modules must be importable on the head: same image"
    header = (ROOT / "deploy" / "serve_config.yaml").read_text()
    wanted = dict(re.findall(r"(RAY_SERVE_\w+)=(\S+)", header))
    for c in (hc, wc):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert wanted.items() <= env.items(), c["name"]
    dep = serve_v2()["applications"][0]["deployments"][0]
    policy = [dep["autoscaling_config"]["policy"]["policy_function"]] if "autoscaling_config" in dep else []
    for path in (
        wanted["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"],
        dep["request_router_config"]["request_router_class"],
        *policy,
    ):
        module, attr = path.split(":")
        assert hasattr(importlib.import_module(module), attr), path


@pytest.mark.parametrize(
    "deployment, bounds",
    [
        ({"autoscaling_config": {"min_replicas": 2, "initial_replicas": 3, "max_replicas": 5}}, (2, 3, 5)),
        ({"autoscaling_config": {"min_replicas": 1, "initial_replicas": None, "max_replicas": 4}}, (1, 1, 4)),
        ({"num_replicas": 3}, (3, 3, 3)),
    ],
)
def test_gpu_worker_bounds_follow_the_serve_deployment(deployment, bounds):
    base = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    dep = base["applications"][0]["deployments"][0]
    dep.pop("num_replicas", None)
    dep.update(deployment)
    _, worker = groups(render.rayservice(yaml.safe_dump(base), "0.1.0"))
    assert (worker["minReplicas"], worker["replicas"], worker["maxReplicas"]) == bounds


def test_manifests_validate_against_the_crds():
    for name, crd in (("rayservice.yaml", RAYSERVICE), ("podmonitor.yaml", PODMONITOR), ("prometheusrule.yaml", RULE)):
        assert schema_errors(crd, manifest(name)) == [], name


def test_crd_validation_rejects_typical_mistakes():
    rs = manifest("rayservice.yaml")
    cluster = rs["spec"]["rayClusterConfig"]
    _, worker = groups(rs)
    (wc,) = worker["template"]["spec"]["containers"]
    cluster["enableInTreeAutoscalling"] = True  # typo: kubectl --validate=strict rejects unknown fields
    worker["rayStartParams"]["num-gpus"] = 1  # must be a string
    wc["resources"]["limits"]["cpu"] = "8 cores"  # not a quantity
    wc["ports"].append({"name": "dup", "containerPort": render.METRICS_PORT})  # same (port, TCP) twice
    del worker["groupName"]
    errors = "\n".join(schema_errors(RAYSERVICE, rs))
    for needle in (
        "enableInTreeAutoscalling",
        "is not of type 'string'",
        "8 cores",
        "duplicate entry",
        "'groupName' is a required property",
    ):
        assert needle in errors, needle
    pm = manifest("podmonitor.yaml")
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    pm["apiVersion"] = "monitoring.coreos.com/v1alpha1"
    assert len(schema_errors(PODMONITOR, pm)) == 2
    pr = manifest("prometheusrule.yaml")
    pr["spec"]["groups"][0]["rules"][0]["for"] = "2 minutes"
    assert schema_errors(RULE, pr)


def test_schemas_are_the_recorded_upstream_crds():
    readme = (K8S / "schemas" / "README.md").read_text()
    files = sorted(p for p in (K8S / "schemas").glob("*.yaml"))
    assert [p.name for p in files] == sorted([RAYSERVICE, PODMONITOR, RULE])
    for path in files:
        assert f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}" in readme, path.name


def test_podmonitor_scrapes_the_replica_metrics_port_of_gpu_workers_only():
    head, worker = groups(manifest("rayservice.yaml"))
    pm = manifest("podmonitor.yaml")["spec"]
    match = pm["selector"]["matchLabels"]
    assert match.items() <= worker["template"]["metadata"]["labels"].items()
    assert not match.items() <= head["template"]["metadata"]["labels"].items()
    (endpoint,) = pm["podMetricsEndpoints"]
    port_names = {p["name"] for p in worker["template"]["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] == rules.METRICS_PORT_NAME in port_names and endpoint["path"] == "/metrics"
    job = {"action": "replace", "targetLabel": "job", "replacement": rules.SCRAPE_JOB}
    assert job in endpoint["relabelings"]


def alerts() -> list[dict]:
    return [r for g in manifest("prometheusrule.yaml")["spec"]["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules_and_their_unit_tests_pass(tmp_path):
    promtool()  # fails with an install hint when missing
    check, unit = render.run_promtool(tmp_path)
    found = f"{len(alerts())} rules found"
    assert check.returncode == 0 and found in check.stdout, check.stdout + check.stderr
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_every_alert_is_unit_tested_firing_and_silent():
    tests = yaml.safe_load((K8S / "tests" / "rules_test.yaml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    for alert in alerts():
        mine = [c for c in cases if c["alertname"] == alert["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{alert['alert']} never shown to fire"
        assert any(not c["exp_alerts"] for c in mine), f"{alert['alert']} never shown to stay silent"


def test_alerts_use_only_exported_metrics_and_have_runbooks():
    exported = exported_names()
    docs = (ROOT / "docs" / "operations.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", docs, flags=re.M)
    }
    assert len(alerts()) >= 5
    for alert in alerts():
        for sel in selectors(alert["expr"]):
            if sel.name == "up":
                matchers = {(m.name, m.value) for m in sel.matchers.matchers}
                assert {("job", rules.SCRAPE_JOB), ("endpoint", rules.METRICS_PORT_NAME)} <= matchers
            else:
                assert sel.name in exported, f"{alert['alert']}: {sel.name} is not exported by a replica"
        ann = alert["annotations"]
        assert ann["summary"] and ann["description"]
        assert alert["labels"]["severity"] in ("critical", "warning")
        assert ann["runbook"] == f"docs/operations.md#{alert['alert'].lower()}"
        assert alert["alert"].lower() in anchors, f"no runbook section {alert['alert']} in docs/operations.md"


def test_kustomization_lists_every_manifest_and_builds():
    kust = manifest("kustomization.yaml")
    assert sorted(kust["resources"]) == sorted(render.render())
    (image,) = kust["images"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert image["name"] == render.IMAGE and image["newTag"] == version
    tool = shutil.which("kustomize") or shutil.which("kubectl")
    if tool is None:
        pytest.fail("neither kustomize nor kubectl on PATH: install one (Debian: kubernetes-client) to build k8s/")
    cmd = [tool, "build", str(K8S)] if tool.endswith("kustomize") else [tool, "kustomize", str(K8S)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "PrometheusRule", "RayService"]
    assert {d["metadata"]["namespace"] for d in docs} == {kust["namespace"]}
    head, worker = groups(next(d for d in docs if d["kind"] == "RayService"))
    for group in (head, worker):
        assert group["template"]["spec"]["containers"][0]["image"] == f"{image['newName']}:{version}"


def test_dockerfile_matches_the_manifests():
    text = (K8S / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_IMAGE=rayproject/ray:{re.escape(render.RAY_VERSION)}-py311-gpu$", text, re.M)
    assert '[gpu,serve,model]"' in text and "vtoken model prepare" in text
    assert f"COPY --chown=ray:users serve_app.py {render.APP_DIR}/serve_app.py" in text
    _, worker = groups(manifest("rayservice.yaml"))
    env = {e["name"]: e.get("value") for e in worker["template"]["spec"]["containers"][0]["env"]}
    for name in ("PYTHONPATH", "VTOKEN_CACHE_DIR", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"):
        assert re.search(rf"^\s*(ENV )?{name}={re.escape(env[name])}( \\)?$", text, re.M), name
    runtime_env = serve_v2()["applications"][0]["runtime_env"]["env_vars"]
    assert json.loads(runtime_env["VTOKEN_SERVE_CONFIG"])["metrics"]["port"] == render.METRICS_PORT


def test_tp2_variant_reserves_two_gpus_per_replica_through_placement_group_bundles():
    """k8s/variants/rayservice-tp2.yaml: committed rendering, valid against the RayService CRD and Serve's
    schema; the replica's bundles are exactly what the serving code computes for its config
    (``replica_bundles``: own CPU bundle + one {CPU, GPU} bundle per rank, STRICT_PACK) and each GPU
    worker pod holds the replica's 2 GPUs."""
    from ray.serve.schema import ServeDeploySchema

    from vtoken.serve.config import ServeAppConfig
    from vtoken.serve.launch.app import deployment_options
    from vtoken.serve.replica.engine import engine_args

    name = "variants/rayservice-tp2.yaml"
    assert (K8S / name).read_text() == render.render_variants()[name]
    rs = manifest(name)
    assert schema_errors(RAYSERVICE, rs) == [] and rs["metadata"]["name"] == "vtoken-tp2"
    v2 = yaml.safe_load(rs["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(v2)
    app = v2["applications"][0]
    cfg = ServeAppConfig.load(app["runtime_env"]["env_vars"]["VTOKEN_SERVE_CONFIG"])
    assert cfg.engine.tensor_parallel_size == 2 and cfg.deployment.gpus_per_rank == 1
    dep = app["deployments"][0]
    opts = deployment_options(cfg)
    assert dep["placement_group_bundles"] == opts["placement_group_bundles"]
    assert dep["placement_group_strategy"] == opts["placement_group_strategy"] == "STRICT_PACK"
    assert sum(b.get("GPU", 0) for b in dep["placement_group_bundles"]) == 2
    assert "num_gpus" not in dep["ray_actor_options"]
    assert engine_args(cfg, "/m")["distributed_executor_backend"] == "ray"
    _, worker = groups(rs)
    res = worker["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2"
    _, base_worker = groups(manifest("rayservice.yaml"))
    assert (worker["minReplicas"], worker["maxReplicas"]) == (base_worker["minReplicas"], base_worker["maxReplicas"])
