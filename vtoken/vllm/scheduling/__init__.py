"""The scheduler side's helpers inside vLLM: block surgery, per-request state, admission, pressure, KV
invariants, pool sizing (``pool_need``) and traces. Imported by ``vtoken.vllm.scheduler``, by ``vtoken.serve``
before an engine starts (``pool_need``, ``pressure``), and by the offline tools and benches."""
