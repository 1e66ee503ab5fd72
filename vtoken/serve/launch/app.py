"""Build the Serve application from a ``ServeAppConfig`` (used by serve_app.py and ``vtoken serve``).

::

    ServeAppConfig ──deployment_options()──▶ @serve.deployment(VTokenReplica)
                                              num_replicas | autoscaling_config (KVAutoscalingPolicy)
                                              request_router_config (KVAwareRouter)
                                              ray_actor_options, max_ongoing/queued_requests, health
                                              placement_group_bundles (TP ranks, replica_bundles)
                   ──bind(cfg)────────────────▶ Application

Everything that can fail on a bad config fails here, at build time (``serve run``/``serve build``/
``vtoken serve``), not in a replica after minutes of restarts.
"""

from __future__ import annotations

from typing import Any

from vtoken.serve.config import ServeAppConfig

ROUTER_CLASS = "vtoken.serve.control.router:KVAwareRouter"
POLICY_CLASS = "vtoken.serve.control.autoscaling:KVAutoscalingPolicy"


def deployment_options(cfg: ServeAppConfig) -> dict[str, Any]:
    """Keyword arguments for ``serve.deployment`` (pure apart from importing Ray's config classes)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    d, a, r = cfg.deployment, cfg.autoscaling, cfg.router
    opts: dict[str, Any] = dict(
        name=d.name,
        ray_actor_options={"num_cpus": d.num_cpus},
        max_ongoing_requests=d.max_ongoing_requests,
        max_queued_requests=d.max_queued_requests,
        health_check_period_s=d.health_check_period_s,
        health_check_timeout_s=d.health_check_timeout_s,
        graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
    )
    if d.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = d.max_replicas_per_node
    bundles = replica_bundles(cfg)
    if bundles is not None:
        opts["placement_group_bundles"] = bundles
        opts["placement_group_strategy"] = "STRICT_PACK"  # the ranks of one replica share a node
    if a.enabled:
        policy = AutoscalingPolicy(policy_function=POLICY_CLASS, policy_kwargs=a.params.kwargs())
        opts["autoscaling_config"] = AutoscalingConfig(**a.serve_options(), policy=policy)
    else:
        opts["num_replicas"] = d.num_replicas
    if r.enabled:
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs=r.params.kwargs(),
            request_routing_stats_period_s=r.stats_period_s,
            request_routing_stats_timeout_s=r.stats_timeout_s,
        )
    return opts


def replica_bundles(cfg: ServeAppConfig) -> list[dict[str, float]] | None:
    """The placement-group bundles one replica reserves (pure), as Ray Serve's LLM deployments do: the
    replica actor's own bundle (its ``ray_actor_options``), then one bundle per tensor-parallel rank — one
    core each on CPU (vLLM's multiprocess executor binds one rank per core), plus ``gpus_per_rank`` GPUs on
    GPU machines (vLLM's Ray executor places its workers in these bundles). ``None`` for TP = 1 without GPUs
    (the plain ``ray_actor_options`` reservation)."""
    e, d = cfg.engine, cfg.deployment
    if e.tensor_parallel_size == 1 and not d.gpus_per_rank:
        return None
    rank = {"CPU": 1.0, **({"GPU": float(d.gpus_per_rank)} if d.gpus_per_rank else {})}
    return [{"CPU": float(d.num_cpus)}] + [dict(rank) for _ in range(e.tensor_parallel_size)]


def build_app(cfg: ServeAppConfig | dict | None = None):
    """The bound Serve ``Application`` for ``cfg`` (a dict is validated into a ``ServeAppConfig``).

    Raises pydantic ``ValidationError`` / ``VTokenUnavailableError`` for a config that cannot run.
    """
    from ray import serve

    from vtoken.serve.replica.deployment import VTokenReplica
    from vtoken.serve.replica.engine import vtoken_engine_kwargs

    if not isinstance(cfg, ServeAppConfig):
        cfg = ServeAppConfig.model_validate(cfg or {})
    vtoken_engine_kwargs(cfg.vtoken)  # fail now if vToken is requested but not installed
    deployment = serve.deployment(serve.ingress()(VTokenReplica), **deployment_options(cfg))
    return deployment.bind(cfg)
