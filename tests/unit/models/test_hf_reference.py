"""vtoken.models.hf_reference: the masked-HF oracle on tiny models (Llama and Qwen2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vtoken.models.hf_reference import (
    LiveTrace,
    greedy_replay,
    load_reference_model,
    masked_logprobs,
    score_trace,
)

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
M = 20


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_llama: Path, tiny_qwen2: Path):
    from transformers import AutoTokenizer

    path = tiny_llama if request.param == "llama" else tiny_qwen2
    prompt = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    model = load_reference_model(path)
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=M, do_sample=False)
    plain = plain[0, len(prompt) :].tolist()
    return model, prompt, plain


def full_live(p: int, m: int) -> list[np.ndarray]:
    return [np.arange(p + s) for s in range(m)]


def window_live(p: int, m: int, sinks: int = 2, recent: int = 6) -> list[np.ndarray]:
    """Step 0 sees the whole prompt (prefill); later steps keep sinks + the recent window only."""
    out = [np.arange(p)]
    for s in range(1, m):
        q = p + s - 1
        out.append(np.union1d(np.arange(sinks), np.arange(max(0, q - recent + 1), q + 1)))
    return out


def test_no_eviction_equals_plain_hf_greedy(setup) -> None:
    model, prompt, plain = setup
    trace = LiveTrace(prompt, plain, full_live(len(prompt), M))
    ref = score_trace(model, trace)
    assert ref.greedy_match(plain).all()
    np.testing.assert_allclose(ref.token_logprobs, ref.top1_logprobs, atol=0)
    assert np.all(ref.token_logprobs < 0) and ref.token_logprobs.shape == (M,)
    assert greedy_replay(model, trace) == plain


def test_mask_is_applied(setup) -> None:
    model, prompt, plain = setup
    full = score_trace(model, LiveTrace(prompt, plain, full_live(len(prompt), M)))
    masked = score_trace(model, LiveTrace(prompt, plain, window_live(len(prompt), M)))
    assert masked.token_logprobs[0] == pytest.approx(full.token_logprobs[0], abs=1e-6)  # step 0: no eviction
    assert np.abs(masked.token_logprobs[1:] - full.token_logprobs[1:]).max() > 1e-2
    replay = greedy_replay(model, LiveTrace(prompt, plain, window_live(len(prompt), M)))
    assert replay != plain
    # The teacher-forced single forward agrees with the incremental replay on its own outputs.
    again = score_trace(model, LiveTrace(prompt, replay, window_live(len(prompt), M)))
    assert again.greedy_match(replay).all()


def test_masking_equals_removing_the_token(setup) -> None:
    """Key j masked for every query == token j removed, other tokens keeping their position ids."""
    model, prompt, plain = setup
    p, j = len(prompt), 3
    prefill = np.tril(np.ones((p, p), dtype=bool))
    prefill[j + 1 :, j] = False
    live = [np.setdiff1d(keys, [j]) for keys in full_live(p, M)]
    ref = score_trace(model, LiveTrace(prompt, plain, live, prefill_visible=prefill))
    ids = prompt + plain[:-1]
    keep = np.array([i for i in range(len(ids)) if i != j])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])[:, keep], position_ids=torch.tensor(keep)[None]).logits
    logp = torch.log_softmax(logits[0].float(), -1)[p - 2 :]  # row of logical p-1 is index p-2 after removal
    removed = logp.gather(1, torch.tensor(plain)[:, None])[:, 0].double().numpy()
    np.testing.assert_allclose(ref.token_logprobs, removed, atol=1e-5, rtol=0)
    plain_ref = score_trace(model, LiveTrace(prompt, plain, full_live(p, M)))
    assert np.abs(ref.token_logprobs - plain_ref.token_logprobs).max() > 1e-3  # removal mattered


def test_decode_time_eviction_equals_pruning_the_kv_cache(setup) -> None:
    """vToken's semantics: keys evicted at step s vanish from the cache; earlier tokens keep the K/V
    computed when those keys were alive. Physically pruning HF's DynamicCache must give the oracle."""
    from transformers import DynamicCache

    from vtoken.models.hf_reference import additive_mask

    model, prompt, _ = setup
    p = len(prompt)
    live = window_live(p, M)
    cache, tokens, lps = DynamicCache(config=model.config), [], []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        alive = np.arange(p)
        for s in range(M):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tokens.append(int(logp.argmax()))
            lps.append(float(logp.max()))
            if s == M - 1:
                break
            q = p + s
            keep = np.flatnonzero(np.isin(alive, live[s + 1]))  # evict before the next forward
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            alive = np.append(alive[keep], q)
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                position_ids=torch.tensor([[q]]),
                attention_mask=additive_mask(np.ones((1, len(alive)), bool)),
                past_key_values=cache,
                use_cache=True,
            )
    trace = LiveTrace(prompt, tokens, live)
    ref = score_trace(model, trace)
    np.testing.assert_allclose(ref.token_logprobs, lps, atol=1e-5, rtol=0)
    assert greedy_replay(model, trace) == tokens


def test_live_trace_validation() -> None:
    with pytest.raises(ValueError, match=r"live_at_step\[1\].*containing 5"):
        LiveTrace([1, 2, 3, 4, 5], [7, 8], [np.arange(5), np.arange(5)])  # step 1 lacks its own key
    with pytest.raises(ValueError, match=r"one per output"):
        LiveTrace([1, 2], [7, 8], [np.arange(2)])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        LiveTrace([1, 2], [7], [np.array([0, 1, 2])])  # a future key
    trace = LiveTrace([1, 2, 3], [7, 8, 9], [np.array([1, 2]), np.array([0, 3]), np.array([2, 4])])
    vis = trace.visibility()
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],  # step 0: the prefill's last row, key 0 evicted by the trace
            [1, 0, 0, 1, 0],
            [0, 0, 1, 0, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(vis, expected)
    assert trace.input_ids() == [1, 2, 3, 7, 8]


def test_requires_eager(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"eager.*'sdpa'"):
        masked_logprobs(sdpa, [1, 2], np.tril(np.ones((2, 2), bool)))
