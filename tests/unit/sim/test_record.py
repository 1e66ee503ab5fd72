"""vtoken.sim.record: attention traces from an HF model, on a tiny model (and the committed real set)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vtoken.sim.record import AttentionTrace, embedded_texts, load_metadata, load_traces, record_traces

GEN = 12


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2: Path) -> tuple[Path, list[str]]:
    texts = list(embedded_texts().values())[:2]
    prompts = [texts[0][:300], texts[1][:200]]
    out = tmp_path_factory.mktemp("traces") / "tiny.npz"
    assert record_traces(tiny_qwen2, prompts, GEN, out, dtype="float32", source="test") == out
    return out, prompts


def test_embedded_texts_are_long_prose() -> None:
    texts = embedded_texts()
    assert len(texts) >= 6 and all(name.endswith(".txt") for name in texts)
    assert all(len(t.split()) >= 300 for t in texts.values())


def test_trace_shapes_causality_and_row_sums(recorded, tiny_qwen2: Path) -> None:
    from transformers import AutoTokenizer

    out, prompts = recorded
    traces = load_traces(out)
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    assert len(traces) == 2
    for trace, text in zip(traces, prompts):
        p = len(tok(text)["input_ids"])
        t = p + GEN
        assert isinstance(trace, AttentionTrace) and trace.prompt_len == p
        assert trace.attn.shape == (t, t) and trace.key_norm.shape == (t,)
        assert trace.attn.dtype == np.float32 and trace.key_norm.dtype == np.float32
        assert np.all(np.triu(trace.attn, 1) == 0)  # strictly causal
        np.testing.assert_allclose(trace.attn.sum(axis=1), 1.0, atol=1e-5)
        assert trace.attn[0, 0] == pytest.approx(1.0, abs=1e-6)
        assert np.all(trace.key_norm > 0) and trace.key_norm.std() > 0


def test_rows_equal_incremental_decode_and_knorm_equals_pre_rope(recorded, tiny_qwen2: Path) -> None:
    """The last row equals what an incremental decode step attends; key norms equal k_proj norms."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    out, prompts = recorded
    trace = load_traces(out)[1]
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, attn_implementation="eager").eval()
    p = trace.prompt_len
    ids = model.generate(torch.tensor([tok(prompts[1])["input_ids"]]), max_new_tokens=GEN, do_sample=False)
    pre: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: pre.append(o.detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
            last = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    row = torch.stack([a[0, :, 0].mean(0) for a in last.attentions]).mean(0).numpy()
    np.testing.assert_allclose(trace.attn[-1], row, atol=1e-6)
    assert ids.shape[1] == p + GEN
    d = model.config.hidden_size // model.config.num_attention_heads
    half = len(pre) // 2  # k_proj outputs: prefill of T-1 tokens per layer, then the last token per layer
    keys = [torch.cat([a, b], dim=1)[0].view(p + GEN, -1, d) for a, b in zip(pre[:half], pre[half:])]
    knorm = torch.stack([k.norm(dim=-1).mean(dim=1) for k in keys]).mean(0).numpy()
    np.testing.assert_allclose(trace.key_norm, knorm, rtol=1e-5)


def test_round_trip_and_metadata(recorded, tmp_path: Path, tiny_qwen2: Path) -> None:
    out, prompts = recorded
    meta = load_metadata(out)
    assert meta["gen_len"] == GEN and meta["count"] == 2 and meta["source"] == "test"
    assert meta["model"] == str(tiny_qwen2) and meta["dtype"] == "float32" and meta["date"][:2] == "20"
    small = record_traces(tiny_qwen2, prompts[:1], GEN, tmp_path / "f16.npz", prompt_len=20)
    (t16,) = load_traces(small)
    t32 = load_traces(out)[0]
    assert t16.prompt_len == 20 and t16.attn.shape == (20 + GEN, 20 + GEN)
    np.testing.assert_allclose(t16.attn[:20, :20], t32.attn[:20, :20], atol=1e-3)  # same prefix, fp16
    np.testing.assert_allclose(t16.attn.sum(axis=1), 1.0, atol=2e-3)
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_record_rejects_short_prompt(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens, fewer than prompt_len=4096"):
        record_traces(tiny_llama, ["short"], 4, tmp_path / "x.npz", prompt_len=4096)
    assert not (tmp_path / "x.npz").exists()


def test_committed_real_traces_are_realistic() -> None:
    """The packaged SmolLM2 traces: 6 × (384 + 128) tokens with a sink and heavy hitters (not uniform)."""
    from importlib import resources

    path = resources.files("vtoken.sim").joinpath("traces/smollm2_prose.npz")
    traces = load_traces(path)
    meta = load_metadata(path)
    assert len(traces) == meta["count"] == 6 and "SmolLM2" in meta["model"] and meta["gen_len"] == 128
    for t in traces:
        assert t.prompt_len == 384 and t.attn.shape == (512, 512) and t.key_norm.shape == (512,)
        assert np.all(np.triu(t.attn, 1) == 0)
        np.testing.assert_allclose(t.attn.sum(axis=1), 1.0, atol=2e-3)  # float16 storage
        last = np.sort(t.attn[-1])[::-1]
        assert last[:51].sum() > 0.6  # top 10% of keys hold most of the mass (random weights: ~0.14)
        assert t.attn[-1, :4].sum() > 0.1  # attention sink on the first tokens
