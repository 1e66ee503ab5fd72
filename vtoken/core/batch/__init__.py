"""Decisions over a running batch rather than one request: SLO-aware admission and eviction under pressure.
Pure (numpy, no vLLM); the vLLM scheduler's mixins (``vtoken.vllm.scheduling``) and ``vtoken.vllm.config``
import it."""
