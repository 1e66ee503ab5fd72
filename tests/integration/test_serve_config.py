"""ServeAppConfig: validation through vtoken.core.config at build time, overrides, Serve options, YAML."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from support.cli import run_vtoken
from support.paths import ROOT

from vtoken.serve.config import ServeAppConfig


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"vtoken": {"policy": "lru"}}, "unknown policy 'lru'"),
        ({"vtoken": {"budget": 1.5}}, "budget fraction must be in (0, 1], got 1.5"),
        ({"vtoken": {"budget": 0}}, "budget count must be a positive integer, got 0"),
        ({"vtoken": {"budget": "lots"}}, "invalid budget 'lots'"),
        ({"vtoken": {"block_size": 48}}, "block size must be a power of two, got 48"),
        ({"vtoken": {"block_size": 16}}, "multiple of 32"),
        ({"vtoken": {"mode": "compact"}}, "unknown reclamation mode 'compact'"),
        ({"vtoken": {"trigger": "often"}}, "unknown repack trigger 'often'"),
        ({"vtoken": {"sinks": -1}}, "sinks must be a non-negative integer"),
        ({"vtokn": {}}, "Extra inputs are not permitted"),
        ({"engine": {"max_model_len": 512}}, "limits.max_tokens 1024 must be below engine.max_model_len 512"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas 3 > max_replicas 2"),
        ({"autoscaling": {"upscale_kv_utilization": 0.3, "downscale_kv_utilization": 0.5}}, "hysteresis"),
        ({"route_prefix": "v1"}, "route_prefix must start with '/'"),
        ({"engine": {"kv_cache_blocks": 64}}, "engine.kv_cache_blocks 64 hold 2016 tokens"),
    ],
)
def test_bad_config_names_the_value(bad, needle):
    with pytest.raises(ValidationError) as err:
        ServeAppConfig.model_validate(bad)
    assert needle in str(err.value)


def test_bad_config_fails_when_the_app_is_built():
    from vtoken.serve.launch.app import build_app

    with pytest.raises(ValidationError, match="unknown policy 'nope'"):
        build_app({"vtoken": {"policy": "nope"}})


def test_merged_accepts_nested_and_dotted_overrides_and_revalidates():
    base = ServeAppConfig()
    cfg = base.merged({"vtoken": {"mode": "none"}, "engine.kv_cache_blocks": "65"}, **{"slo.ttft_ms": 500})
    assert (cfg.vtoken.mode, cfg.vtoken.policy, cfg.engine.kv_cache_blocks, cfg.slo.ttft_ms) == (
        "none",
        "h2o",
        65,
        500,
    )
    assert base.vtoken.mode == "repack"  # pure
    with pytest.raises(ValidationError, match="unknown reclamation mode"):
        base.merged({"vtoken.mode": "bogus"})


def test_load_from_inline_json_yaml_file_and_env(tmp_path, monkeypatch):
    assert ServeAppConfig.load('{"model": "tiny-llama"}').model == "tiny-llama"
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny-llama\nvtoken:\n  policy: tova\n  budget: 128\n")
    cfg = ServeAppConfig.load(path)
    assert (cfg.vtoken.policy, cfg.vtoken.budget.count) == ("tova", 128)
    monkeypatch.setenv("VTOKEN_SERVE_CONFIG", json.dumps({"vtoken": {"mode": "naive"}}))
    assert ServeAppConfig.load().vtoken.mode == "naive"


def test_api_key_from_env_or_config():
    cfg = ServeAppConfig()
    assert cfg.limits.resolved_api_key({}) is None
    assert cfg.limits.resolved_api_key({"VTOKEN_API_KEY": "k1"}) == "k1"
    cfg = ServeAppConfig.model_validate({"limits": {"api_key": "k2"}})
    assert cfg.limits.resolved_api_key({"VTOKEN_API_KEY": "k1"}) == "k2"
    assert "k2" not in cfg.model_dump_json()


def test_deployment_options_router_autoscaling_and_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from vtoken.serve.launch.app import POLICY_CLASS, ROUTER_CLASS, deployment_options

    cfg = ServeAppConfig.model_validate(
        {
            "autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 3},
            "router": {"stale_after_s": 3.0},
        }
    )
    opts = deployment_options(cfg)
    assert "num_replicas" not in opts
    auto = opts["autoscaling_config"]
    assert (auto.min_replicas, auto.max_replicas, auto.policy.policy_function) == (1, 3, POLICY_CLASS)
    assert auto.policy.policy_kwargs["upscale_kv_utilization"] == 0.75
    router = opts["request_router_config"]
    assert router.request_router_class == ROUTER_CLASS and router.request_router_kwargs["stale_after_s"] == 3.0
    fixed = deployment_options(
        ServeAppConfig.model_validate({"deployment": {"num_replicas": 2}, "router": {"enabled": False}})
    )
    assert fixed["num_replicas"] == 2 and "request_router_config" not in fixed
    ServeDeploySchema.model_validate({"applications": [{"name": "vtoken", "import_path": "serve_app:app"}]})


def test_engine_args_and_cpu_binding():
    from vtoken.serve.replica.engine import cpu_binding, engine_args

    cfg = ServeAppConfig.model_validate({"vtoken": {"mode": "repack", "budget": 64}, "engine": {"kv_cache_blocks": 65}})
    kw = engine_args(cfg, "/models/x")
    assert kw["num_gpu_blocks_override"] == 65 and kw["block_size"] == 32 and not kw["disable_log_stats"]
    assert kw["scheduler_cls"].startswith("vtoken.vllm") and kw["additional_config"]["vtoken"]["budget"] == 64
    none = engine_args(cfg.merged({"vtoken.mode": "none"}), "/models/x")
    assert "scheduler_cls" not in none
    two = ServeAppConfig.model_validate({"deployment": {"num_replicas": 2}})
    assert [cpu_binding(two, r, ncpu=2) for r in (0, 1)] == ["0", "1"]
    assert cpu_binding(ServeAppConfig(), 0, ncpu=2) == "0-1"
    assert [cpu_binding(two, r, ncpu=8) for r in (0, 1)] == ["0-3", "4-7"]


def test_checked_in_serve_build_yaml_matches_the_default_config():
    """deploy/serve_config.yaml is `serve build serve_app:app` output: valid, and in sync with the code."""

    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = ROOT / "deploy" / "serve_config.yaml"
    doc = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(doc)
    app = doc["applications"][0]
    assert app["import_path"] == "serve_app:app"
    dep = app["deployments"][0]
    assert dep["name"] == ServeAppConfig().deployment.name
    assert dep["request_router_config"]["request_router_class"] == "vtoken.serve.control.router:KVAwareRouter"


def test_serve_app_entry_points_build_from_env_and_dotted_args(monkeypatch):
    """serve_app:app reads $VTOKEN_SERVE_CONFIG; serve_app:build takes `serve run` key=value args."""
    import importlib.util

    monkeypatch.setenv("VTOKEN_SERVE_CONFIG", '{"model": "tiny-llama", "vtoken": {"mode": "none"}}')
    path = ROOT / "serve_app.py"
    spec = importlib.util.spec_from_file_location("serve_app_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.app._bound_deployment.init_args[0]
    assert (cfg.model, cfg.vtoken.mode) == ("tiny-llama", "none")
    built = module.build({"vtoken.policy": "tova", "engine.kv_cache_blocks": "65"})
    cfg = built._bound_deployment.init_args[0]
    assert (cfg.model, cfg.vtoken.policy, cfg.engine.kv_cache_blocks) == ("tiny-llama", "tova", 65)
    with pytest.raises(ValidationError, match="unknown policy 'lru'"):
        module.build({"vtoken.policy": "lru"})


def test_tensor_parallel_replica_reserves_a_bundle_per_rank():
    """engine.tensor_parallel_size: the engine gets TP ranks (mp executor on CPU, Ray's on GPUs), the
    replica reserves its own bundle plus one per rank (STRICT_PACK, as Ray Serve's LLM deployments do), and
    on CPU each rank binds its own cores."""
    from ray.serve.schema import DeploymentSchema

    from vtoken.serve.launch.app import deployment_options, replica_bundles
    from vtoken.serve.replica.engine import cpu_binding, engine_args

    assert replica_bundles(ServeAppConfig()) is None and "placement_group_bundles" not in deployment_options(
        ServeAppConfig()
    )
    tp2 = ServeAppConfig.model_validate({"engine": {"tensor_parallel_size": 2}})
    opts = deployment_options(tp2)
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}  # fits the first bundle
    kw = engine_args(tp2, "/models/x")
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert cpu_binding(tp2, 0, ncpu=2) == "0|1" and cpu_binding(tp2, 0, ncpu=8) == "0-3|4-7"
    gpu = tp2.merged({"deployment.gpus_per_rank": 1})
    assert deployment_options(gpu)["placement_group_bundles"] == [
        {"CPU": 0.5},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    assert engine_args(gpu, "/m")["distributed_executor_backend"] == "ray"
    DeploymentSchema.model_validate(
        {
            "name": "VTokenReplica",
            "placement_group_bundles": opts["placement_group_bundles"],
            "placement_group_strategy": "STRICT_PACK",
            "ray_actor_options": {"num_cpus": 0.5},
        }
    )
    assert "tensor_parallel_size" not in engine_args(ServeAppConfig(), "/m")


def test_vtoken_serve_exits_with_the_refusal_before_starting_anything():
    """`vtoken serve` with an engine feature vToken refuses (fp8 KV cache) exits 2 with the message naming
    it, before Ray or a replica starts (preflight: vLLM's engine config, no weights)."""
    proc = run_vtoken(
        "serve",
        "--model",
        "tiny-llama",
        "--mode",
        "repack",
        "--set",
        "engine.kv_cache_dtype=fp8",
        "--port",
        "18999",
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "quantized KV cache (kv_cache_dtype='fp8')" in proc.stderr and "docs/support.md" in proc.stderr
    assert "Ray" not in proc.stdout  # nothing started


@pytest.mark.parametrize("mode", ["none", "repack"])
def test_vtoken_serve_refuses_a_pool_under_the_hybrid_models_need_by_name(mode):
    """The tiny Gemma 3 has 4 KV cache groups: at max_model_len 1024 vLLM needs 32 + 3 x 33 + 1 = 132 blocks
    (``pool_need``), not the 33 a one-group model needs. 100 blocks pass the one-group check, so before the
    preflight counted groups the replica died inside the engine and `vtoken serve` said only that it could
    not start; now it exits 2 naming engine.kv_cache_blocks and what fits, in every mode, before Ray starts."""
    proc = run_vtoken(
        "serve",
        "--model",
        "tiny-gemma3",
        "--mode",
        mode,
        "--set",
        "engine.kv_cache_blocks=100",
        "--set",
        "engine.max_model_len=1024",
        "--set",
        "limits.max_tokens=64",
        "--port",
        "18998",
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "engine.kv_cache_blocks 100 is too small for engine.max_model_len 1024" in proc.stderr
    assert "4 KV cache group(s)" in proc.stderr and "= 132 blocks" in proc.stderr
    assert "lower engine.max_model_len to 768" in proc.stderr  # 4 x 24 + 3 + 1 = 100
    assert "Ray" not in proc.stdout  # nothing started


@pytest.mark.parametrize(
    ("model", "extra", "named"),
    [("tiny-llama", {"tensor_parallel_size": 2}, "tensor_parallel_size=2"), ("tiny-gemma3", {}, "hybrid model")],
)
def test_preflight_refuses_pressure_where_it_cannot_run_by_name(model, extra, named):
    """``trigger: pressure`` on TP or a hybrid model is refused by `vtoken serve`'s preflight (vLLM's engine
    config, no weights), before Ray or a replica starts; ``trigger: step`` on the same config passes."""
    from vtoken.errors import ConfigError
    from vtoken.serve.replica.engine import preflight, resolve_model_path

    def config(trigger: str) -> ServeAppConfig:
        vt = {"mode": "repack", "policy": "h2o", "budget": 0.5, "trigger": trigger}
        return ServeAppConfig.model_validate({"model": model, "vtoken": vt, "engine": extra})

    path = resolve_model_path(model)
    with pytest.raises(ConfigError, match=rf"trigger 'pressure' is not supported with .*{named}"):
        preflight(config("pressure"), path)
    preflight(config("step"), path)
