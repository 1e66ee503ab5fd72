"""The worker side inside vLLM: the start-up every vToken worker runs (``worker_base``), the model-runner
mixin, the CPU and CUDA workers and runners, score capture under CUDA graphs, tensor parallelism and the
per-step ``StepResult``. Imported by ``vtoken.vllm.worker`` (the platform's classes, on that platform only)."""
