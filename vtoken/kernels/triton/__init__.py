"""The Triton kernels (slot moves, attention scores, key norms, a decode-attention yardstick) and their
launch runtime: compiled on CUDA, interpreted on CPU tensors. Imported by the CUDA runner
(``vtoken.vllm.runner.gpu``), ``kernels.backend_check``, ``vtoken bench`` and ``scripts/gpu_check.py``."""
