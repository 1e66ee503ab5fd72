"""FULL CUDA graphs kept when a subset of the layers scores (issue 41, item 3): the chosen mode, the request
refusals, and — on the GPU runner built without vLLM's constructor, CPU tensors laid out like the CUDA
backends' views — a step whose scored layers' queries were copied into the persistent buffers by a *replayed*
capture (no Python ran in the forward) gives the same statistics as the per-layer hook of the PIECEWISE path.

The CUDA graph is emulated: a ``TorchDispatchMode`` records every tensor op the forward's Python issues while
the runner has no step (as at vLLM's capture), and the replay re-issues those ops on the same tensor objects
(fixed addresses) after the step's queries were written in place — no wrapper runs at replay."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vtoken.errors import ConfigError
from vtoken.kernels.gpu_layout import allocate_kv_caches
from vtoken.kernels.triton.scores import TritonScoreAccumulator
from vtoken.vllm.transport import RequestStep, StepPlan, StepResult, result_of

L, NB, B, KVH, QH, D, MAX_TOKENS = 4, 12, 32, 2, 4, 32, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 3, 1)]  # vLLM's group order ≠ forward order


def _compilation(mode: str, split: str = "attention"):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = CompilationConfig()
    cc.mode = CompilationMode.VLLM_COMPILE
    cc.splitting_ops = [] if split == "empty" else list(cc._attention_ops) + ["vllm::unified_kv_cache_update"]
    cc.use_inductor_graph_partition = False
    cc.cudagraph_mode = CUDAGraphMode[mode]
    return cc


def _engine(mode: str, depth: int = L, split: str = "attention", **vtoken):
    """A stand-in for the engine's ``VllmConfig``: what ``choose_cudagraph_mode`` and the runner read."""
    from vtoken.vllm.config import EngineSettings

    cfg = SimpleNamespace(
        additional_config={"vtoken": {"policy": "h2o", **vtoken}},
        cache_config=SimpleNamespace(block_size=B),
        compilation_config=_compilation(mode, split),
        model_config=SimpleNamespace(get_num_layers_by_block_type=lambda parallel, kind: depth),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return cfg, EngineSettings.from_additional_config(cfg.additional_config, B)


@pytest.mark.parametrize(
    "policy,scores,score_layers,split,start,expect",
    [
        ("h2o", "auto", 1, "attention", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),  # the default
        ("tova", "auto", 3, "attention", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
        ("snapkv", "auto", 1, "attention", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
        ("random", "always", 1, "attention", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
        ("h2o", "auto", 1, "empty", "FULL", "FULL"),  # attention inside the graph: the copy is replayed too
        ("h2o", "auto", None, "attention", "FULL_AND_PIECEWISE", "PIECEWISE"),  # every layer: the hook
        ("scissorhands", "auto", L, "attention", "FULL_AND_PIECEWISE", "PIECEWISE"),  # ≥ depth: every layer
        ("h2o", "auto", None, "empty", "FULL", "NONE"),
        ("h2o", "auto", 1, "attention", "PIECEWISE", "PIECEWISE"),  # attention eager: the hook serves all
        ("knorm", "auto", 1, "attention", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),  # query-free
    ],
)
def test_layer_subsets_keep_vllms_cudagraph_mode(policy, scores, score_layers, split, start, expect):
    """``score_layers`` below the depth keeps vLLM's mode (FULL_AND_PIECEWISE by default) and scores through
    the query buffers; policies that need every layer keep today's PIECEWISE (or NONE) choice."""
    from vllm.config.compilation import CUDAGraphMode

    from vtoken.vllm.engine_setup import captures_queries, choose_cudagraph_mode

    cfg, settings = _engine(start, split=split, policy=policy, scores=scores, score_layers=score_layers)
    restricted = choose_cudagraph_mode(cfg, settings)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[expect]
    buffered = policy != "knorm" and expect != "PIECEWISE" and expect != "NONE"
    assert captures_queries(cfg, settings) == buffered
    assert restricted == (buffered or policy == "knorm")


def test_requests_cannot_score_layers_the_graphs_do_not_buffer():
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm.engine_setup import refuse_under_full_graphs

    _, engine = _engine("FULL_AND_PIECEWISE", score_layers=2)
    refuse_under_full_graphs(VTokenConfig(policy="tova", score_layers=2), engine)  # the buffered layers
    refuse_under_full_graphs(VTokenConfig(policy="random", score_layers=None), engine)  # no statistics
    for other in (1, None):
        with pytest.raises(ConfigError, match="cannot score other layers"):
            refuse_under_full_graphs(VTokenConfig(policy="h2o", score_layers=other), engine)
        with pytest.raises(ConfigError, match="cannot score other layers"):
            refuse_under_full_graphs(VTokenConfig(policy="h2o", score_layers=other), engine.cfg)
    _, knorm = _engine("FULL_AND_PIECEWISE", policy="knorm")
    with pytest.raises(ConfigError, match="query-free policy 'knorm'"):
        refuse_under_full_graphs(VTokenConfig(policy="h2o"), knorm)
    _, always = _engine("FULL_AND_PIECEWISE", policy="random", scores="always")
    refuse_under_full_graphs(VTokenConfig(policy="h2o"), always)  # scores: always buffers its queries


def _runner(mode: str, kind: str, **vtoken):
    """A ``VTokenGPUModelRunner`` without vLLM's constructor, set up for an engine in ``mode`` (after
    ``choose_cudagraph_mode``); the same cache contents every time."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vtoken.vllm.engine_setup import choose_cudagraph_mode
    from vtoken.vllm.runner.gpu import VTokenGPUModelRunner

    views = allocate_kv_caches("flash_attn", L, NB, B, KVH, D, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen))

    def kernel(layer, query, key, value, kv_cache, attn_metadata, *args, output=None, **kwargs):
        output.copy_(query.flatten(1))  # stands for vLLM's attention kernel: a device op, recorded at capture
        return output

    ctx = {
        name: SimpleNamespace(
            kv_cache=v,
            impl=SimpleNamespace(scale=0.25, forward=kernel, kv_cache_dtype="auto", num_heads=QH, head_size=D),
        )
        for name, v in zip(NAMES, views)
    }
    r = object.__new__(VTokenGPUModelRunner)
    r.device, r.max_num_tokens = torch.device("cpu"), MAX_TOKENS
    r.cache_config = SimpleNamespace(block_size=B)
    spec = FullAttentionSpec(block_size=B, num_kv_heads=KVH, head_size=D, dtype=torch.float32)
    r.kv_cache_config = SimpleNamespace(
        kv_cache_layout="LBNHC", kv_cache_groups=[SimpleNamespace(layer_names=NAMES, kv_cache_spec=spec)]
    )
    r.attn_groups = [[]]
    r.compilation_config = SimpleNamespace(static_forward_context=ctx)
    r.vllm_config, settings = _engine(mode, **vtoken)
    choose_cudagraph_mode(r.vllm_config, settings)
    if kind == "triton":
        r._vt_make_accumulator = lambda layout: TritonScoreAccumulator(layout)
    r._vt_setup()
    return r, ctx


# the step: a decode, a 3-query prefill chunk ending the prompt (SnapKV's window) and a decode with a kept
# range starting at slot 9; rows: live keys 0..seq_len-1 through the block ids
REQS = {"a": (0, 1, 40, [3, 7], 0, 0), "b": (1, 4, 30, [5], 3, 0), "c": (4, 5, 70, [1, 9, 11], 0, 9)}
N_TOKENS, PADDED = 5, 8  # the graph runs a padded batch of 8 tokens


def _prepare(r, score_layers):
    """What ``_prepare_inputs`` hands ``_vt_collect`` for the step (the runner's own collect builds the
    accumulators)."""
    steps = {
        rid: RequestStep(offset=0, scores=True, window=w, score_layers=score_layers, first=first)
        for rid, (_, _, _, _, w, first) in REQS.items()
    }
    table = np.zeros((3, 4), np.int32)
    for i, (*_, row, _, _) in enumerate(REQS.values()):
        table[i, : len(row)] = row
    rows = SimpleNamespace(
        block_size=B,
        num_blocks_per_row=np.array([len(v[3]) for v in REQS.values()]),
        block_table=SimpleNamespace(np=table),
        slot_mapping=SimpleNamespace(gpu=torch.zeros(PADDED, dtype=torch.int64)),
    )
    r.optimistic_seq_lens_cpu = torch.tensor([v[2] for v in REQS.values()])
    qsl = np.array([0, 1, 4, 5])
    plan = StepPlan(src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64), requests=steps, step=11)
    r._vt_plan, r._vt_result = plan, StepResult(step=11)
    r._vt_collect(plan, list(REQS), qsl, rows)


def _queries(seed):
    """Each layer's query for the padded batch (forward order), as views of a fused qkv buffer (strided)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(L, PADDED, (QH + 2 * KVH) * D, generator=gen)
    return [qkv[p, :, : QH * D].view(PADDED, QH, D) for p in range(L)]


def _forward(r, ctx, queries):
    """The model's attention layers in forward order, each through its (wrapped) ``impl.forward``."""
    by_place = sorted(zip(_places(), NAMES))
    outputs = [torch.empty(PADDED, QH * D) for _ in range(L)]
    for (place, name), out in zip(by_place, outputs):
        layer = ctx[name]
        layer.impl.forward(layer, queries[place], None, None, layer.kv_cache, object(), output=out)


def _places():
    from vtoken.vllm.runner.mixin import _forward_order

    return _forward_order(NAMES)


class _Graph(TorchDispatchMode):
    """Records the tensor ops issued while capturing; ``replay`` re-issues them on the same tensors."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def replay(self):
        for func, args, kwargs in self.ops:
            func(*args, **kwargs)


def _scores(r, out_ids=("a", "b", "c")):
    from vllm.v1.outputs import ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=list(out_ids), req_id_to_index={k: i for i, k in enumerate(out_ids)})
    return result_of(r._vt_attach(out)).scores


def _execute(r, monkeypatch, forward):
    """``VTokenRunnerMixin.execute_model`` with vLLM's own ``execute_model`` replaced by ``forward``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(GPUModelRunner, "execute_model", lambda self, so, it=None: forward())
    assert r.execute_model(SimpleNamespace()) is None


@pytest.mark.parametrize("kind", ["torch", "triton"])
@pytest.mark.parametrize("score_layers", [1, 2])
def test_buffered_queries_replayed_by_a_graph_score_like_the_per_layer_hook(kind, score_layers, monkeypatch):
    """The same step, scored (a) by the per-layer hook under PIECEWISE (attention eager) and (b) from the
    query buffers filled by a replayed capture of the forward, then scored after it: equal statistics."""
    piecewise, pctx = _runner("PIECEWISE", kind, score_layers=score_layers)
    full, fctx = _runner("FULL_AND_PIECEWISE", kind, score_layers=score_layers)
    assert piecewise._vt_capture is None and full._vt_capture is not None
    assert full.vllm_config.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    step = _queries(seed=5)

    # (a) PIECEWISE: attention runs eagerly, the hook folds each scored layer in during the forward
    _prepare(piecewise, score_layers)
    _execute(piecewise, monkeypatch, lambda: _forward(piecewise, pctx, step))
    want = _scores(piecewise)

    # (b) FULL: captured once with no step running (garbage queries), replayed with the step's queries
    static = _queries(seed=99)
    graph = _Graph()
    with graph:
        _forward(full, fctx, static)
    names = [func.__name__ for func, *_ in graph.ops]
    assert names.count("copy_.default") == L + score_layers  # the kernels' outputs + one copy per scored layer
    assert not {"_local_scalar_dense.default", "item.default"} & set(names)  # no host sync in the forward
    for s, q in zip(static, step):
        s.copy_(q)  # what the graph computes from this step's inputs
    for layer in fctx.values():  # a replay runs no Python: a wrapper called now would fail the test
        layer.impl.forward = None
    _prepare(full, score_layers)
    _execute(full, monkeypatch, graph.replay)
    got = _scores(full)

    assert set(got) == set(want) == set(REQS)
    for rid in REQS:
        for field in ("accumulated", "last", "unimportant", "window"):
            a, b = getattr(got[rid], field), getattr(want[rid], field)
            assert (a is None) == (b is None), (rid, field)
            assert a is None or np.array_equal(a, b), (rid, field)
        assert got[rid].first == want[rid].first and got[rid].accumulated is not None


def test_a_request_outside_the_buffered_layers_fails_the_step():
    """Defence behind the scheduler's refusal: a request whose scored layers were not buffered raises
    instead of returning statistics from fewer layers."""
    r, _ = _runner("FULL_AND_PIECEWISE", "torch", score_layers=1)
    assert r._vt_capture.scored == frozenset({3})
    with pytest.raises(RuntimeError, match=r"buffers the queries of layers \[3\] only"):
        _prepare(r, None)
    with pytest.raises(RuntimeError, match=r"scores attention layers \[1, 3\]"):
        _prepare(r, 2)


def test_query_buffers_are_fixed_and_refuse_what_does_not_fit():
    """One buffer per scored layer, allocated once (a rebuilt cache keeps it: captured graphs hold its
    address); a query that does not fit raises at capture time."""
    r, ctx = _runner("FULL_AND_PIECEWISE", "torch", score_layers=2)
    bufs = r._vt_capture.buffers
    assert [tuple(b.shape) for b in bufs] == [(MAX_TOKENS, QH, D)] * 2 and r._vt_capture.scored == {1, 3}
    r._vt_setup()
    assert all(a is b for a, b in zip(r._vt_capture.buffers, bufs))
    layer = ctx[NAMES[3]]  # forward place 1: a scored layer
    big = torch.zeros(MAX_TOKENS + 1, QH, D)
    with pytest.raises(RuntimeError, match="does not fit"):
        layer.impl.forward(layer, big, None, None, layer.kv_cache, None, output=torch.empty(MAX_TOKENS + 1, QH * D))
