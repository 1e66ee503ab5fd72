"""The one worker name on both platforms, the GPU runner's parts on CPU tensors, and the engine choices
(V1 runner, CUDA-graph mode) on hand-built vLLM configs. No GPU: the GPU classes are driven through a
runner object built without vLLM's constructor (``object.__new__``), with views laid out the way vLLM 0.32's
CUDA backends lay them out (``allocate_kv_caches``); Triton kernels run in its interpreter."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vtoken.errors import ConfigError
from vtoken.kernels.gpu_layout import PagedScoreAccumulator, PagedTorchMover, allocate_kv_caches, read_k
from vtoken.kernels.scores import RequestScores
from vtoken.kernels.triton.knorm import TritonKeyNorms
from vtoken.kernels.triton.moves import TritonSlotMover
from vtoken.kernels.triton.scores import TritonScoreAccumulator
from vtoken.vllm.transport import StepPlan, StepResult, result_of


def _platform(kind):
    return SimpleNamespace(is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda", device_name=kind)


def test_one_worker_name_builds_the_platforms_worker(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vtoken.vllm import WORKER_CLS, engine_kwargs
    from vtoken.vllm.internals import is_vtoken_worker
    from vtoken.vllm.runner.cpu import VTokenCPUWorker
    from vtoken.vllm.runner.gpu import VTokenGPUModelRunner, VTokenGPUWorker
    from vtoken.vllm.runner.mixin import VTokenRunnerMixin
    from vtoken.vllm.runner.worker_base import VTokenWorkerBase
    from vtoken.vllm.worker import VTokenWorker, platform_worker_class

    assert WORKER_CLS == "vtoken.vllm.worker.VTokenWorker" and engine_kwargs()["worker_cls"] == WORKER_CLS
    assert platform_worker_class(_platform("cpu")) is VTokenCPUWorker
    assert platform_worker_class(_platform("cuda")) is VTokenGPUWorker
    with pytest.raises(ConfigError, match="'rocm'"):
        platform_worker_class(_platform("rocm"))
    assert platform_worker_class() is VTokenCPUWorker  # this machine: vLLM's CPU platform

    class Built:  # stands in for the platform worker: built once, with the arguments vLLM passed
        inits = 0

        def __init__(self, *args, **kwargs):
            Built.inits += 1
            self.args, self.kwargs = args, kwargs

    monkeypatch.setattr("vtoken.vllm.worker.platform_worker_class", lambda: Built)
    worker = VTokenWorker("vllm_config", rank=0)
    assert type(worker) is Built and (worker.args, worker.kwargs, Built.inits) == (("vllm_config",), {"rank": 0}, 1)
    assert issubclass(VTokenGPUWorker, VTokenWorkerBase) and issubclass(VTokenCPUWorker, VTokenWorkerBase)
    assert issubclass(VTokenGPUModelRunner, VTokenRunnerMixin)
    assert issubclass(VTokenGPUModelRunner, GPUModelRunner)
    for name in (WORKER_CLS, "vtoken.vllm.runner.cpu.VTokenCPUWorker", "vtoken.vllm.runner.gpu.VTokenGPUWorker"):
        assert is_vtoken_worker(name)


L, NB, B, H, D = 2, 10, 16, 2, 32


def _gpu_runner(block_size=B, layout="flash_attn", dtype=torch.float32):
    """A ``VTokenGPUModelRunner`` without vLLM's constructor: just what the vToken hooks read."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vtoken.vllm.runner.gpu import VTokenGPUModelRunner

    views = allocate_kv_caches(layout, L, NB, B, H, D, dtype)
    gen = torch.Generator().manual_seed(0)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    calls = []

    def forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        calls.append(("kernel", kv_cache))
        return query

    ctx = {
        f"l{i}": SimpleNamespace(kv_cache=v, impl=SimpleNamespace(scale=0.5, forward=forward, kv_cache_dtype="auto"))
        for i, v in enumerate(views)
    }
    r = object.__new__(VTokenGPUModelRunner)
    r.device = torch.device("cpu")
    r.cache_config = SimpleNamespace(block_size=block_size)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=dtype)
    r.kv_cache_config = SimpleNamespace(
        kv_cache_layout="LBNHC", kv_cache_groups=[SimpleNamespace(layer_names=list(ctx), kv_cache_spec=spec)]
    )
    r.attn_groups = [[]]  # one KV cache group, no metadata builders to wrap
    r.compilation_config = SimpleNamespace(static_forward_context=ctx)
    return r, views, ctx, calls


def test_gpu_runner_layout_mover_and_scores_come_from_the_cache_view():
    r, views, ctx, calls = _gpu_runner()
    r._vt_setup()
    assert r._vt_paged is r._vt_layout and r._vt_layout.name == "LBNHC" and r._vt_layout.block_size == B
    assert type(r._vt_mover) is TritonSlotMover
    assert type(r._vt_make_accumulator(r._vt_layout)) is PagedScoreAccumulator  # CPU tensors: the reference
    r.device = SimpleNamespace(type="cuda")
    assert type(r._vt_make_accumulator(r._vt_layout)) is TritonScoreAccumulator
    r.device = torch.device("cpu")
    # the moves of a step, every layer, equal the torch reference element for element
    ref = [v.clone() for v in views]
    src, dst = np.array([70, 41, 150, 3], np.int64), np.array([5, 6, 22, 40], np.int64)
    r._vt_result = StepResult(step=7)
    r._vt_move(StepPlan(src=src, dst=dst, step=7))
    PagedTorchMover(r._vt_layout).move(ref, torch.from_numpy(src), torch.from_numpy(dst))
    assert all(torch.equal(a, b) for a, b in zip(views, ref))
    assert r._vt_result.num_moves == 4 and r._vt_result.move_seconds > 0
    # the attention wrapper runs vLLM's kernel, then folds q·K in (keys come from the cache, not `key`)
    got = []
    r._vt_acc = SimpleNamespace(add_layer=lambda q, k, kv, scale, layer: got.append((k, kv, scale, layer)))
    ctx["l1"].impl.forward(ctx["l1"], "q", "k", "v", views[1], object())
    # … telling the accumulator which layer it is (forward order: score_layers skips the others)
    assert calls == [("kernel", views[1])] and got == [(None, views[1], 0.5, 1)] and r._vt_depth == L
    # key norms of the new tokens, read back from the cache after the forward
    slots = torch.tensor([5, 6, 22])
    r._vt_norm_slots = slots
    r._vt_key_norms()
    want = sum(read_k(v, r._vt_layout, slots).float().norm(dim=-1).mean(dim=-1) for v in views)
    assert torch.allclose(r._vt_norm_sum, want) and r._vt_norm_layers == L
    # on CUDA one Triton launch reads every layer's (here run by Triton's interpreter): the same sums
    assert r._vt_knorm is None  # CPU tensors: the torch loop above
    r.device = SimpleNamespace(type="cuda")
    assert type(r._vt_make_key_norms(r._vt_layout)) is TritonKeyNorms
    r.device = torch.device("cpu")
    knorm, launches = TritonKeyNorms(r._vt_layout), []
    r._vt_knorm = SimpleNamespace(sum=lambda caches, s: launches.append(len(caches)) or knorm.sum(caches, s))
    r._vt_norm_sum = None
    r._vt_key_norms()
    assert launches == [L] and torch.allclose(r._vt_norm_sum, want, atol=1e-5) and r._vt_norm_layers == L


def test_gpu_runner_refuses_caches_it_cannot_address():
    r, *_ = _gpu_runner(block_size=32)  # the backend split 32-token blocks into 16-token kernel blocks
    with pytest.raises(RuntimeError, match="set --block-size 16"):
        r._vt_setup()
    r, _, ctx, _ = _gpu_runner()
    ctx["l0"].impl.kv_cache_dtype = "fp8_e4m3"
    with pytest.raises(ConfigError, match="quantized KV cache .*fp8"):  # start-up: vtoken/vllm/supported_configs.py
        r._vt_setup()


def test_results_are_finished_when_an_async_output_is_read():
    """Async scheduling: ``sample_tokens`` returns vLLM's async output at once; the step's scores (and
    key norms) are reduced and attached when the output is read, after vLLM's own copy."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from vtoken.vllm.runner.step_result import DeferredResultOutput

    order = []

    class Inner(AsyncModelRunnerOutput):
        def get_output(self):
            order.append("vllm")
            return ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[1]])

    r, views, *_ = _gpu_runner()
    r._vt_setup()
    acc = r._vt_make_accumulator(r._vt_layout)
    acc.requests["a"] = RequestScores(
        q_start=0, q_end=1, seq_len=20, block_row=torch.tensor([3, 7]), want_attention=True, want_key_norm=False
    )
    query = torch.randn(1, 4, D)
    for v in views:
        acc.add_layer(query, None, v, 0.5)
    r._vt_result, r._vt_acc = StepResult(step=3), acc
    r._vt_norm_reqs, r._vt_norm_slots = {"a": (0, 1, 20)}, torch.tensor([3 * B + 3])
    r._vt_key_norms()
    out = r._vt_attach(Inner())
    assert isinstance(out, DeferredResultOutput) and isinstance(out, AsyncModelRunnerOutput) and not order
    res = result_of(out.get_output())
    assert order == ["vllm"] and res.step == 3 and set(res.scores) == {"a"}
    s = res.scores["a"]
    assert s.accumulated.shape == (20,) and abs(s.accumulated.sum() - 1.0) < 1e-5 and s.key_norm.shape == (1,)
    # a step whose attention hook never ran (a FULL CUDA-graph replay) fails instead of returning nothing
    acc = r._vt_make_accumulator(r._vt_layout)
    acc.requests["a"] = RequestScores(
        q_start=0, q_end=1, seq_len=20, block_row=torch.tensor([3, 7]), want_attention=True, want_key_norm=False
    )
    r._vt_result, r._vt_acc = StepResult(step=4), acc
    with pytest.raises(RuntimeError, match="FULL CUDA graph"):
        r._vt_attach(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))


def test_gpu_runner_warms_the_triton_kernels_up_at_start_up(monkeypatch):
    """CUDA: the mover's and the score kernels' variants compile when the KV cache is set up, not during the
    first requests (issue 24, defect 6); the warm-ups themselves are tests/unit/kernels/test_triton_warmup.py."""
    r, views, ctx, _ = _gpu_runner()
    for layer in ctx.values():
        layer.impl.num_heads, layer.impl.head_size = 4, D
    calls = []
    monkeypatch.setattr(TritonSlotMover, "warmup", lambda self, caches: calls.append(("mover", self, caches)))
    monkeypatch.setattr(
        TritonScoreAccumulator,
        "warmup",
        classmethod(
            lambda cls, layout, kv, heads, head_dim, dtype, scale: calls.append(
                ("scores", layout, kv, heads, head_dim, dtype, scale)
            )
        ),
    )
    r._vt_setup()
    assert calls == []  # CPU tensors: the interpreter compiles nothing
    r.device = SimpleNamespace(type="cuda")
    r._vt_make_readback = lambda: None  # no CUDA streams on this machine
    r._vt_setup()
    assert calls == [
        ("mover", r._vt_mover, r._vt_kv_tensors),
        ("scores", r._vt_layout, views[0], 4, D, views[0].dtype, 0.5),
    ]
    assert r._vt_kv_tensors == tuple(views)


class _FakeCuda:
    """``torch.cuda`` as ``HostReadback`` uses it, logging every wait and record (CPU tensors stand in)."""

    def __init__(self):
        self.log = []
        cuda = self

        class Stream:
            def __init__(self, name="copy"):
                self.name = name

            def wait_stream(self, other):
                cuda.log.append(("wait_stream", self.name, other.name))

            def synchronize(self):
                cuda.log.append(("stream_sync", self.name))

        class Event:
            def record(self, stream=None):
                cuda.log.append(("record", cuda.active))

            def synchronize(self):
                cuda.log.append(("event_sync",))

        self.Stream, self.Event, self.active, self._default = Stream, Event, "default", Stream("default")

    def current_stream(self):
        return self._default

    def stream(self, s):
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            self.active = s.name
            yield
            self.active = "default"

        return ctx()

    def synchronize(self):
        self.log.append(("device_sync",))


class _DeviceTensor(torch.Tensor):
    """Stands for device memory: anything computed from it stays one, and reading one on the host
    (``.cpu()``, ``.numpy()``, ``.item()``, ``.tolist()``: an implicit stream sync on CUDA) is recorded."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("cpu", "numpy", "item", "tolist"):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("kind", ["triton", "torch"])
def test_async_readback_waits_for_its_own_copy_only(kind):
    """Async scheduling reads step N's output after step N+1 was enqueued: the statistics must have been
    copied when N's work ended (side stream, event), and ``get_output`` may wait on that event only — a read
    of a device buffer there (``.cpu()``) would wait for N+1's forward (issue 24, defect 2)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from vtoken.vllm.runner.step_result import HostReadback

    class Inner(AsyncModelRunnerOutput):
        def get_output(self):
            return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[1], [2]])

    r, views, *_ = _gpu_runner()
    r._vt_setup()
    assert r._vt_readback is None  # a CPU device: nothing to copy
    cuda = _FakeCuda()
    r._vt_readback = HostReadback(cuda)

    def step(step_no):
        make = TritonScoreAccumulator if kind == "triton" else PagedScoreAccumulator
        acc = make(r._vt_layout)
        for rid, q0 in (("a", 0), ("b", 1)):
            acc.requests[rid] = RequestScores(
                q_start=q0,
                q_end=q0 + 1,
                seq_len=20 + q0,
                block_row=torch.tensor([3 + q0, 7]),
                want_attention=True,
                want_key_norm=False,
            )
        query = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(step_no))
        for v in views:
            acc.add_layer(query, None, v, 0.5)
        r._vt_result, r._vt_acc = StepResult(step=step_no), acc
        r._vt_norm_reqs, r._vt_norm_slots = {"a": (0, 1, 20)}, torch.tensor([3 * B + 3])
        r._vt_key_norms()
        want = result_of(attach_step_result_copy(acc, r._vt_norm_sum))
        acc.to_host(lambda t: t.as_subclass(_DeviceTensor))  # the step's buffers now stand for device memory
        r._vt_norm_sum = r._vt_norm_sum.as_subclass(_DeviceTensor)
        return r._vt_attach(Inner()), want

    from copy import deepcopy

    from vtoken.vllm.runner.step_result import attach_step_result

    def attach_step_result_copy(acc, norm_sum):  # the synchronous result of the same statistics
        parts = (StepResult(step=0), deepcopy(acc), {"a": (0, 1, 20)}, norm_sum.clone(), L, None)
        return attach_step_result(ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}), parts)

    out, want = step(5)
    assert cuda.log == [("wait_stream", "copy", "default"), ("record", "copy")]  # copied after step 5's work
    out6, *_ = step(6)  # step 6 is enqueued before step 5's output is read
    cuda.log.clear()
    _DeviceTensor.reads.clear()
    res = result_of(out.get_output())
    # no device buffer read on the host (an implicit sync), no stream or device sync: the event only
    assert _DeviceTensor.reads == [] and cuda.log == [("event_sync",)]
    assert res.step == 5 and set(res.scores) == {"a", "b"}
    for rid in ("a", "b"):  # the same statistics as the synchronous path
        for field in ("accumulated", "last", "unimportant", "key_norm"):
            got, ref = getattr(res.scores[rid], field), getattr(want.scores[rid], field)
            assert (got is None) == (ref is None) and (got is None or np.array_equal(got, ref)), (rid, field)


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from vtoken.models.tiny import tiny_model

    def make():
        model = ModelConfig(
            model=str(tiny_model("llama")), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=256
        )
        return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32))

    return make


def test_v1_runner_is_pinned_on_the_engines_config(vllm_config, monkeypatch):
    """Where Triton runs (CUDA), vLLM 0.32 picks Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER says
    otherwise; vToken pins V1 on the engine's own config object, no environment variable needed."""
    import vllm.config.vllm as vllm_config_module
    from vllm import envs

    from vtoken.vllm.engine_setup import V1RunnerVllmConfig, pin_v1_model_runner

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    cfg, other = vllm_config(), vllm_config()
    assert cfg.use_v2_model_runner  # what a CUDA engine gets by default
    pin_v1_model_runner(cfg)
    pin_v1_model_runner(cfg)
    assert type(cfg) is V1RunnerVllmConfig and not cfg.use_v2_model_runner
    assert other.use_v2_model_runner  # another engine's config is untouched
    back = pickle.loads(pickle.dumps(cfg))  # worker processes receive it pickled
    assert type(back) is V1RunnerVllmConfig and not back.use_v2_model_runner
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    envs.disable_envs_cache()
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        pin_v1_model_runner(vllm_config())


_CUDA_SPLIT = "attention"  # vLLM's CUDA default: splitting_ops = the attention ops (+ KV-cache update)


@pytest.mark.parametrize(
    "policy,scores,compile_mode,split,expect,score_layers",
    [
        ("h2o", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "PIECEWISE", None),
        ("tova", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "PIECEWISE", None),
        ("scissorhands", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "PIECEWISE", None),
        ("snapkv", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "PIECEWISE", 2),  # 2 of the tiny model's 2: every layer
        ("h2o", "auto", "NONE", _CUDA_SPLIT, "NONE", None),
        ("random", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "FULL_AND_PIECEWISE", None),
        ("streamingllm", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "FULL_AND_PIECEWISE", None),
        ("knorm", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "FULL_AND_PIECEWISE", None),
        ("random", "always", "VLLM_COMPILE", _CUDA_SPLIT, "PIECEWISE", None),
        # splitting_ops=[] (or attention fusion): vLLM already made it FULL; PIECEWISE would capture attention
        ("h2o", "auto", "VLLM_COMPILE", "empty", "NONE", None),
        ("snapkv", "auto", "VLLM_COMPILE", "empty", "NONE", None),
        ("knorm", "auto", "VLLM_COMPILE", "empty", "FULL_AND_PIECEWISE", None),
        # Inductor's graph partition splits at the attention ops too
        ("h2o", "auto", "VLLM_COMPILE", "inductor-partition", "PIECEWISE", None),
        # a subset of the layers (the default, 1): queries buffered inside the graphs, vLLM's mode kept
        ("h2o", "auto", "VLLM_COMPILE", _CUDA_SPLIT, "FULL_AND_PIECEWISE", 1),
        ("h2o", "auto", "VLLM_COMPILE", "empty", "FULL_AND_PIECEWISE", 1),
    ],
)
def test_cudagraph_mode_per_policy(vllm_config, policy, scores, compile_mode, split, expect, score_layers, caplog):
    """Query-free policies keep vLLM's FULL graphs, and so do attention policies that score a subset of the
    layers (their queries are copied inside the graphs: tests/unit/vllm/test_vllm_full_graphs.py); every-layer
    attention statistics get PIECEWISE (their q·K hook is Python, which FULL graphs do not replay) only where
    attention is split out of the captured pieces, NONE otherwise, with the setting named in the log (issue
    24, defect 3)."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from vtoken.vllm.config import EngineSettings
    from vtoken.vllm.engine_setup import choose_cudagraph_mode

    cfg = vllm_config()
    cc = cfg.compilation_config
    cc.mode = CompilationMode[compile_mode]
    cc.splitting_ops = [] if split == "empty" else list(cc._attention_ops) + ["vllm::unified_kv_cache_update"]
    cc.use_inductor_graph_partition = split == "inductor-partition"
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's CUDA default
    raw = {"policy": policy, "scores": scores, "score_layers": score_layers}
    settings = EngineSettings.from_additional_config({"vtoken": raw}, 32)
    with caplog.at_level("WARNING", logger="vtoken.vllm"):
        full = choose_cudagraph_mode(cfg, settings)
    assert cc.cudagraph_mode == CUDAGraphMode[expect]
    assert full == (expect == "FULL_AND_PIECEWISE")
    if expect == "NONE":
        assert cc.cudagraph_capture_sizes == []
        assert ("splitting_ops=[]" if split == "empty" else "compilation_config.mode=NONE") in caplog.text
    # an explicit PIECEWISE over a graph that holds attention is not kept either (every layer), and a
    # buffered subset keeps it (the copies are replayed)
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    choose_cudagraph_mode(cfg, settings)
    kept = CUDAGraphMode.NONE if expect == "NONE" else CUDAGraphMode.PIECEWISE
    assert cc.cudagraph_mode == kept
