"""What the core reports, declared once: an engine's KV statistics (``engine_kv``) and what eviction cost each
request (``request_cost``). Read by the engine-free manager, the vLLM scheduler and gauges, the serve
telemetry and the fleet bench."""
