"""Attention statistics under CUDA graphs: the scored layers' queries copied into persistent buffers inside
the forward, the score kernels launched after it (``QueryCapture``).

A FULL CUDA graph replays the kernels recorded at capture and no Python, so a per-layer score hook (the
``impl.forward`` wrapper of ``VTokenRunnerMixin._vt_wrap``) would never run on a replay. When an engine scores a
subset of its attention layers (``score_layers``, 1 by default; ``engine_setup.captures_queries``), each
scored layer's ``impl.forward`` is wrapped instead to copy its query into a buffer allocated once at KV
set-up, at an address fixed for the engine's lifetime, and the runner scores those buffers after the
forward, on the same stream, on eager steps and graph replays alike::

    buffers (one per scored layer, forward order; dtype and heads of the layer's queries)
        buf[j]  [max_tokens, num_heads, head_size]   contiguous, allocated at set-up, never reallocated
                 ├─ rows 0..T-1: the forward's tokens (T = query.shape[0], the padded batch of the graph)
                 └─ rows T..   : stale (a bigger batch's), never read

    forward (eager, PIECEWISE or FULL capture; the same Python runs at capture, no Python at replay)
        layer ℓ ∈ scored   out = vLLM's kernel(...)      writes this step's keys into kv_cache[ℓ]
                           buf[j][:T].copy_(query)      one device copy: no host sync, no branch on data
    after the forward (``score``, from ``execute_model``)
        acc.add_layer(buf[j][:n], None, kv_cache[ℓ], scale[ℓ], layer=ℓ)   for each scored ℓ, in order
                           n = the step's scheduled tokens (≤ T; the requests index rows < n)

Exactness: the score kernels read the same query values and the same cache contents as the per-layer hook
(only layer ℓ's attention writes ``kv_cache[ℓ]``, before the copy; nothing writes it again until the next
step's moves, which are enqueued after ``score``), in the same layer order, so the statistics equal the hook
path's (``tests/unit/vllm/test_vllm_full_graphs.py``). The copy must not depend on the step: at capture no step is
running (``_vt_acc`` is None) and the copy is recorded all the same. Invariants checked in the wrapper are
static per captured shape (dtype, heads, ``T ≤ max_tokens``) and raise at capture, never at replay.
"""

from __future__ import annotations

from typing import Any

import torch

from vtoken.core.config import score_layer_indices


class QueryCapture:
    """The persistent query buffers of the scored layers and the post-forward scoring (see the module).

    ``layers``: the engine's attention layers (their ``impl`` and ``kv_cache``) in vLLM's group order;
    ``order[i]``: layer ``i``'s place in the forward order; ``score_layers``/``depth``: which places score
    (``score_layer_indices``); ``max_tokens``: the most tokens a forward carries (vLLM's ``max_num_tokens``).
    Allocates one ``[max_tokens, num_heads, head_size]`` buffer per scored layer on the cache's device."""

    def __init__(self, layers, order: list[int], score_layers: int | None, depth: int, max_tokens: int) -> None:
        wanted = set(score_layer_indices(score_layers, depth))
        self.scored = frozenset(wanted)  # forward-order places whose queries are buffered
        self.every_layer = len(wanted) == depth
        self._entries: list[tuple[int, Any, torch.Tensor]] = []  # (place, layer, buffer), forward order
        for place, layer in sorted(zip(order, layers), key=lambda pair: pair[0]):
            if place not in wanted:
                continue
            impl, kv = layer.impl, layer.kv_cache
            shape = (max_tokens, int(impl.num_heads), int(impl.head_size))
            buf = getattr(impl, "_vtoken_query_buffer", None)  # a rebuilt cache: the wrapper's own buffer
            if buf is None or tuple(buf.shape) != shape or buf.dtype != kv.dtype or buf.device != kv.device:
                buf = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            self._entries.append((place, layer, buf))
        self.buffers = tuple(buf for _, _, buf in self._entries)

    def wrap(self) -> None:
        """Wrap each scored layer's ``impl.forward`` (per instance; idempotent) to copy its query into the
        layer's buffer after vLLM's kernel, unconditionally (so a CUDA graph capture records the copy).
        Raises ``RuntimeError`` (at capture or an eager step, never mid-replay) when a query does not fit."""
        for place, layer, buf in self._entries:
            impl = layer.impl
            if getattr(impl, "_vtoken_wrapped", False):
                if getattr(impl, "_vtoken_query_buffer", None) is not buf:
                    raise RuntimeError(f"vToken: attention layer {place} was wrapped without a query buffer")
                continue
            orig = impl.forward

            def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _orig=orig, _buf=buf, **kwargs):
                out = _orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
                n = query.shape[0]
                if query.dtype != _buf.dtype or tuple(query.shape[1:]) != tuple(_buf.shape[1:]) or n > _buf.shape[0]:
                    raise RuntimeError(
                        f"vToken: a {query.dtype} query of shape {tuple(query.shape)} does not fit the scored "
                        f"layer's query buffer {tuple(_buf.shape)} ({_buf.dtype})"
                    )
                _buf[:n].copy_(query)
                return out

            impl.forward = forward
            impl._vtoken_wrapped, impl._vtoken_query_buffer = True, buf

    def check_covers(self, rid: str, layers: frozenset[int] | None) -> None:
        """Raise ``RuntimeError`` when a request's scored layers (``None``: every layer) are not all
        buffered (the scheduler refuses such requests: ``engine_setup.refuse_under_full_graphs``)."""
        covered = self.every_layer if layers is None else layers <= self.scored
        if not covered:
            raise RuntimeError(
                f"vToken: request {rid} scores attention layers {'all' if layers is None else sorted(layers)}, "
                f"but this engine buffers the queries of layers {sorted(self.scored)} only (CUDA graphs)"
            )

    def score(self, acc, n_tokens: int) -> None:
        """Fold every scored layer's buffered query (rows ``0..n_tokens-1``) into ``acc`` (the step's
        ``LayerGroups``: each group takes the layers it scores), in forward order. Enqueues the score
        kernels on the current stream, after the forward that filled the buffers; reads no device memory on
        the host."""
        for place, layer, buf in self._entries:
            acc.add_layer(buf[:n_tokens], None, layer.kv_cache, float(layer.impl.scale), layer=place)


def query_capture(runner, layers, order: list[int]) -> QueryCapture | None:
    """``runner``'s ``QueryCapture`` when its engine scores through query buffers (``engine_setup
    .captures_queries`` on ``runner.vllm_config``, after ``choose_cudagraph_mode``), else ``None`` (the
    per-layer hook scores; also for a runner without a config). ``layers``/``order``: as ``QueryCapture``
    takes them; the scored places are spread over ``len(layers)`` (the KV cache group vToken manages), the
    buffers sized by ``runner.max_num_tokens`` (vLLM's most tokens in a forward). Allocates them; wraps
    nothing."""
    vllm_config = getattr(runner, "vllm_config", None)
    if vllm_config is None:
        return None
    from vtoken.vllm.config import EngineSettings
    from vtoken.vllm.engine_setup import captures_queries

    settings = EngineSettings.from_additional_config(vllm_config.additional_config, vllm_config.cache_config.block_size)
    if not captures_queries(vllm_config, settings):
        return None
    return QueryCapture(layers, order, settings.cfg.score_layers, len(layers), int(runner.max_num_tokens))
