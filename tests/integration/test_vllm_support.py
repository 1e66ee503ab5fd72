"""Start-up refusals (vtoken/vllm/supported_configs.py): every engine configuration vToken cannot keep exact fails
when the engine is constructed, with a message naming the feature, so no request ever reaches it.

Unit tests check ``check_kv_spec`` / ``check_attention_layer`` with hand-built specs and layer
implementations (features only special models have: ALiBi, soft cap, sinks, MLA, chunked local attention),
``check_engine_config`` with the ``VllmConfig`` vLLM builds for each refused option; the engine tests
build ``vllm.LLM`` (in-process, tiny Llama) with vToken's ``engine_kwargs`` for each row of ``REFUSED``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest

from vtoken.errors import ConfigError
from vtoken.vllm.supported_configs import check_attention_layer, check_engine_config, check_kv_spec

# feature -> (extra engine kwargs, the words the refusal must contain)
REFUSED = {
    "fp8_kv_cache": ({"kv_cache_dtype": "fp8"}, "quantized KV cache"),
    "pipeline_parallel": ({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}, "pipeline parallelism"),
    "pooling_runner": ({"runner": "pooling"}, "'pooling' runner"),
    "speculative_decoding": (
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
                "prompt_lookup_min": 1,
            }
        },
        "speculative decoding",
    ),
    "sliding_window": ({"disable_hybrid_kv_cache_manager": True}, "sliding-window attention"),
    # a hybrid model vToken runs has one full-attention group; 1 sliding + 3 global layers make 3
    "hybrid_several_full_groups": (
        {},
        "4 KV cache groups (FullAttentionSpec, SlidingWindowSpec) with 3 full-attention groups",
    ),
}
SLIDING_MODEL = ("sliding_window",)
HYBRID_MODEL = ("hybrid_several_full_groups",)


# ------------------------------------------------------------------------------ unit: KV specs
def _spec(cls_name: str = "FullAttentionSpec", **kw):
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    base = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    return getattr(kvi, cls_name)(**base, **kw)


def test_plain_full_attention_spec_is_accepted():
    check_kv_spec(_spec())


@pytest.mark.parametrize(
    "cls_name,kw,needle",
    [
        ("FullAttentionSpec", {"sliding_window": 64}, "sliding-window attention"),
        ("FullAttentionSpec", {"attention_chunk_size": 64}, "chunked local attention"),
        ("FullAttentionSpec", {"non_causal": True}, "non-causal"),
        ("FullAttentionSpec", {"kv_quant_mode": "FP8_PER_TENSOR"}, "quantized KV cache"),
        ("FullAttentionSpec", {"head_size_v": 16}, "different K and V head sizes"),
        ("SlidingWindowSpec", {"sliding_window": 64}, "SlidingWindowSpec"),
        ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 64}, "ChunkedLocalAttentionSpec"),
        ("MLAAttentionSpec", {}, "MLAAttentionSpec"),
    ],
)
def test_kv_spec_variants_are_refused_by_name(cls_name, kw, needle):
    from vllm.v1.kv_cache_interface import KVQuantMode

    if "kv_quant_mode" in kw:
        kw = {**kw, "kv_quant_mode": KVQuantMode[kw["kv_quant_mode"]]}
    with pytest.raises(ConfigError, match=needle):
        check_kv_spec(_spec(cls_name, **kw))


# ------------------------------------------------------------------------------ unit: layer impls
def _impl(**kw):
    base = {
        "alibi_slopes": None,
        "logits_soft_cap": None,
        "sinks": None,
        "sliding_window": None,
        "kv_cache_dtype": "auto",
        "attn_type": "decoder",
    }
    return SimpleNamespace(**{**base, **kw})


def test_plain_decoder_layer_is_accepted():
    check_attention_layer("model.layers.0.self_attn.attn", _impl())
    check_attention_layer("l", _impl(sliding_window=-1, logits_soft_cap=0.0))


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
        ({"logits_soft_cap": 50.0}, "soft-capping"),
        ({"sinks": [0.0, 0.0]}, "attention sinks"),
        ({"sliding_window": 64}, "sliding-window attention"),
        ({"sliding_window": (63, 0)}, "sliding-window attention"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "quantized KV cache"),
        ({"attn_type": "encoder_only"}, "encoder_only attention"),
        ({"attn_type": "encoder_decoder"}, "encoder_decoder attention"),
    ],
)
def test_layer_features_are_refused_by_name(kw, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        check_attention_layer("model.layers.1.self_attn.attn", _impl(**kw))
    assert "model.layers.1.self_attn.attn" in str(e.value) and "docs/support.md" in str(e.value)


def _groups(*kinds):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    extra = {"SlidingWindowSpec": {"sliding_window": 64}, "ChunkedLocalAttentionSpec": {"attention_chunk_size": 64}}
    return [KVCacheGroupSpec([f"model.layers.{i}.attn"], _spec(k, **extra.get(k, {}))) for i, k in enumerate(kinds)]


def test_the_managed_group_of_a_hybrid_model_is_its_one_full_attention_group():
    from vtoken.vllm.supported_configs import full_attention_group

    assert full_attention_group(_groups("FullAttentionSpec")) == 0
    assert full_attention_group(_groups("SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec")) == 2
    with pytest.raises(ConfigError, match="2 full-attention groups"):
        full_attention_group(_groups("SlidingWindowSpec", "FullAttentionSpec", "FullAttentionSpec"))
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec layers"):
        full_attention_group(_groups("ChunkedLocalAttentionSpec", "FullAttentionSpec"))
    with pytest.raises(ConfigError, match="SlidingWindowSpec"):  # a lone sliding group: nothing to manage
        full_attention_group(_groups("SlidingWindowSpec"))


def test_a_hybrid_model_is_refused_on_cuda_until_proven_there():
    """The worker refuses a hybrid model when its KV cache is built on a CUDA device (the per-group lengths
    have run on the CPU backend only); the same groups pass the group check."""
    from types import SimpleNamespace

    import torch

    from vtoken.vllm.runner.mixin import VTokenRunnerMixin

    groups = _groups("SlidingWindowSpec", "FullAttentionSpec")
    runner = VTokenRunnerMixin()
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=groups)
    runner.device = torch.device("cuda")
    with pytest.raises(ConfigError, match="a hybrid model \\(2 KV cache groups\\) on CUDA"):
        runner._vt_setup()


# ------------------------------------------------------------------------------ engine construction
@pytest.fixture(scope="module")
def sliding_llama(tiny_llama):
    """Tiny Llama whose first layer is a sliding-window layer (``layer_types``): with vLLM's hybrid KV cache
    manager disabled its only KV group is a FullAttentionSpec *with* a window."""
    d = tempfile.mkdtemp(prefix="vtoken-sliding-")
    shutil.copytree(tiny_llama, d, dirs_exist_ok=True)
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg.update(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def global_heavy_gemma3():
    """The tiny Gemma 3 with layer kinds [sliding, global, global, global]: vLLM's hybrid manager groups
    one layer per group, so the global layers fill 3 full-attention groups."""
    from vtoken.models.tiny import tiny_model

    d = tempfile.mkdtemp(prefix="vtoken-gemma3-")
    src = tiny_model("gemma3")
    shutil.copytree(src, d, dirs_exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention"] + ["full_attention"] * 3)
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _model_for(feature, tiny_llama, sliding_llama, hybrid):
    return sliding_llama if feature in SLIDING_MODEL else hybrid if feature in HYBRID_MODEL else str(tiny_llama)


def _kwargs(feature):
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm import engine_kwargs

    kw = engine_kwargs(VTokenConfig(policy="knorm", budget=0.5, mode="repack", block_size=32))
    kw.update(REFUSED[feature][0])
    return kw


@pytest.mark.parametrize("feature", [f for f in REFUSED if f not in SLIDING_MODEL + HYBRID_MODEL])
def test_engine_config_refusals_name_the_feature(feature, tiny_llama):
    """``check_engine_config`` on the ``VllmConfig`` vLLM itself builds from the user's options."""
    from vllm.engine.arg_utils import EngineArgs

    kw = _kwargs(feature)
    vcfg = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=512, **kw).create_engine_config()
    with pytest.raises(ConfigError, match=REFUSED[feature][1]):
        check_engine_config(vcfg)


# feature -> (extra engine kwargs, extra config.json fields, the words the refusal must contain). vLLM 0.32
# builds these configs on this machine, but its CPU platform turns dual-batch overlap off and its attention
# backends cannot run micro-batches, so they are refused on the config only (no engine construction).
UBATCH_REFUSED = {
    # the CPU platform resets enable_dbo (CUDA keeps it): the test sets it back on the config vLLM built
    "dual_batch_overlap": ({"enable_dbo": True}, {}, "dual-batch overlap (enable_dbo=True)"),
    # vLLM accepts micro-batching only with an expert-parallel all2all backend; the config builds without it
    "micro_batching": (
        {"ubatch_size": 2, "all2all_backend": "deepep_low_latency"},
        {},
        "micro-batching (ubatch_size=2)",
    ),
    # vLLM reads model_config.is_mm_prefix_lm from the HF config's field of that name (else a model list)
    "mm_prefix_lm": ({}, {"is_mm_prefix_lm": True}, "an mm-prefix language model (model_config.is_mm_prefix_lm"),
}


@pytest.mark.parametrize("feature", list(UBATCH_REFUSED))
def test_micro_batching_and_mm_prefix_models_are_refused_by_name(feature, tiny_llama, tmp_path):
    """Dual-batch overlap / micro-batching (vLLM's ``use_ubatching``) and mm-prefix LMs are refused by
    ``check_engine_config`` on the ``VllmConfig`` vLLM builds from those options, naming the option and why
    (whole-batch score offsets; logical ``num_computed_tokens`` against compacted rows)."""
    from vllm.engine.arg_utils import EngineArgs

    engine_kw, hf_fields, needle = UBATCH_REFUSED[feature]
    model = str(tiny_llama)
    if hf_fields:
        shutil.copytree(tiny_llama, tmp_path / "model")
        cfg = json.loads((tiny_llama / "config.json").read_text())
        (tmp_path / "model" / "config.json").write_text(json.dumps({**cfg, **hf_fields}))
        model = str(tmp_path / "model")
    kw = {**_kwargs_without_refusal(), **engine_kw}
    vcfg = EngineArgs(model=model, dtype="float32", max_model_len=512, **kw).create_engine_config()
    if feature == "dual_batch_overlap":
        assert not vcfg.parallel_config.enable_dbo  # vLLM's CPU platform dropped it
        vcfg.parallel_config.enable_dbo = True
    if feature != "mm_prefix_lm":
        assert vcfg.parallel_config.use_ubatching
    else:
        assert vcfg.model_config.is_mm_prefix_lm
    with pytest.raises(ConfigError) as e:
        check_engine_config(vcfg)
    text = str(e.value)
    assert needle in text and "docs/support.md" in text, text
    if feature != "mm_prefix_lm":
        assert "whole-batch offsets" in text and "num_computed_tokens" in text, text
    else:
        assert "logical token ranges" in text, text


def _kwargs_without_refusal():
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm import engine_kwargs

    return engine_kwargs(VTokenConfig(policy="knorm", budget=0.5, mode="repack", block_size=32))


@pytest.mark.parametrize("feature", list(REFUSED))
def test_a_refused_feature_never_reaches_a_first_request(
    feature, tiny_llama, sliding_llama, global_heavy_gemma3, capfd
):
    """For every row of the refusal table, constructing the engine (vLLM's ``LLM``, in-process, vToken's
    ``engine_kwargs``) raises vToken's ``ConfigError`` — so no request can be submitted to it — and the
    error names the feature (with worker processes, PP: vLLM's start-up error, the worker's message in
    its log)."""
    from vllm import LLM

    from vtoken.vllm.offline.launch import scoped_env, tp_cpu_env

    llm = None
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **tp_cpu_env(2)}
    with pytest.raises(Exception) as e, scoped_env(**env):
        llm = LLM(
            model=_model_for(feature, tiny_llama, sliding_llama, global_heavy_gemma3),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            gpu_memory_utilization=0.5,
            **_kwargs(feature),
        )
    assert llm is None
    if "distributed_executor_backend" in REFUSED[feature][0]:  # worker processes: vLLM re-raises generically,
        assert "initialization failed" in str(e.value)  # the worker's ConfigError is in its log
        cap = capfd.readouterr()
        text = cap.out + cap.err
        assert "ConfigError: vToken cannot run this engine" in text
    else:
        assert isinstance(e.value, ConfigError), repr(e.value)
        text = str(e.value)
    assert REFUSED[feature][1] in text and "docs/support.md" in text, text
    gc.collect()


def test_vtoken_verify_refuses_a_hybrid_model_in_one_line(global_heavy_gemma3):
    """``vtoken verify`` on a model vToken refuses at engine construction (a hybrid model whose global layers
    fill 3 KV cache groups) exits 2 with one ``error:`` line naming it — no traceback."""
    from typer.testing import CliRunner

    from vtoken.cli import app

    r = CliRunner().invoke(
        app,
        [
            "verify",
            "--model",
            global_heavy_gemma3,
            "--policy",
            "h2o",
            "--budget",
            "0.5",
            "--mode",
            "repack",
            "--block-size",
            "32",
        ],
    )
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and REFUSED["hybrid_several_full_groups"][1] in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.exception is None or isinstance(r.exception, SystemExit)
    gc.collect()


def test_a_refusal_inside_the_engine_reaches_the_replica_with_its_message(monkeypatch):
    """vLLM re-raises an engine core's start-up failure without its cause's message; the Serve replica
    starts its engine inside ``refusal_reported``, which turns the refusal the engine wrote into its
    ``ConfigError`` — and Serve's status message into what ``vtoken serve`` prints."""
    from vtoken.serve.launch.local import failure_reason
    from vtoken.serve.replica.engine import refusal_reported
    from vtoken.vllm.supported_configs import REFUSAL_FILE_ENV

    def engine_that_refuses():  # what happens in the engine core process: it inherits the environment
        with pytest.raises(ConfigError):
            check_attention_layer("model.layers.0.attn", _impl(alibi_slopes=[0.5]))
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    with (
        pytest.raises(ConfigError, match="vToken cannot run this engine: ALiBi position biases") as info,
        refusal_reported(),
    ):
        engine_that_refuses()
    assert "initialization failed" in str(info.value.__cause__)
    assert REFUSAL_FILE_ENV not in os.environ
    with (
        pytest.raises(RuntimeError, match="initialization failed"),  # any other failure: unchanged
        refusal_reported(),
    ):
        raise RuntimeError("Engine core initialization failed. See root cause above.")
    status = (
        "The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n  ...\n"
        f"vtoken.errors.ConfigError: {info.value}\n"
    )
    assert failure_reason([status, ""], "fallback") == str(info.value)
    assert failure_reason(["Deploying failed.\nRuntimeError: boom\n"], "fallback") == "RuntimeError: boom"
    assert failure_reason([], "fallback") == "fallback"
