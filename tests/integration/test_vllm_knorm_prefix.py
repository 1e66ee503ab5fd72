"""KNorm with prefix-cache hits (vLLM's default): the keys a request takes from the prefix cache were
computed by no step of it, yet their norms must be known (the worker reads them back from the cache,
``RequestStep.norm_back``) — otherwise they all score 0 and KNorm degenerates to "evict the oldest" for them.

One in-process engine with prefix caching on and the whole prompt in one step (so a cold and a warm
request decide at the same rounds): a cold KNorm request, a vanilla request that leaves the prompt's
blocks in the cache, then the same KNorm request again, served mostly from the cache. The victims (the
round each token was evicted before) must be identical and both runs exact against the masked reference.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from vtoken.vllm.offline.launch import start_engine
from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow


def _sp(max_tokens: int, **vt):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, extra_args={"vtoken": vt}
    )


@pytest.mark.parametrize("arch", ["llama"])
def test_knorm_victims_are_the_same_with_and_without_a_prefix_hit(arch, tmp_path):
    from vtoken.models.hf_reference import load_reference_model
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm.offline.verify import reference_scores

    path = tiny_model(arch)
    llm = start_engine(str(path), 32, str(tmp_path), enable_prefix_caching=True, max_model_len=512, recent=8)
    try:
        prompt = np.random.default_rng(7).integers(10, 500, 200).tolist()
        kn = {"policy": "knorm", "mode": "repack", "budget": 0.3}
        cold = llm.generate([{"prompt_token_ids": prompt}], [_sp(24, trace_id="kn-cold", **kn)], use_tqdm=False)[0]
        llm.generate([{"prompt_token_ids": prompt}], [_sp(1, mode="none", trace_id="kn-fill")], use_tqdm=False)
        warm = llm.generate([{"prompt_token_ids": prompt}], [_sp(24, trace_id="kn-warm", **kn)], use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    tc, tw = (RequestTrace.read(tmp_path / f"kn-{k}.json") for k in ("cold", "warm"))
    assert tc.epochs[0].hits == 0 and tw.epochs[0].hits >= 192, (tc.epochs[0].hits, tw.epochs[0].hits)
    assert tc.evicted > 0
    ev_cold, ev_warm = (np.asarray(t.epochs[0].evicted_round) for t in (tc, tw))
    assert np.array_equal(ev_cold, ev_warm), (
        f"victims differ with a prefix hit: cold evicted {np.flatnonzero(ev_cold >= 0)[:20]}, "
        f"warm {np.flatnonzero(ev_warm >= 0)[:20]}"
    )
    assert list(cold.outputs[0].token_ids) == list(warm.outputs[0].token_ids)
    ref = load_reference_model(path)
    for out, trace in ((cold, tc), (warm, tw)):
        tokens = list(out.outputs[0].token_ids)
        lps = np.array([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
        top, ref_lp = reference_scores(ref, prompt, tokens, trace)
        assert np.array_equal(top, tokens) and np.max(np.abs(lps - ref_lp)) <= 1e-4
