"""Score only what can be evicted, through vLLM's real engine (CPU, in-process, tiny Llama, 64-token prefill
chunks): the scheduler sends each scored request its first evictable slot (``RequestStep.first``), steps
where nothing is evictable (the prefill under ``scope: generated``) score nothing, and the victims and tokens
are those of the full range (``first_scored`` patched to 0: what every step scored before).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from vtoken.vllm.offline.launch import start_engine
from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow

P = 150  # prompt tokens (three prefill chunks)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vtoken.models.tiny import tiny_model

    d = tmp_path_factory.mktemp("traces")
    llm = start_engine(str(tiny_model("llama")), 32, str(d), max_num_batched_tokens=64, max_model_len=512, recent=8)
    yield llm, d
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _generate(llm, d, trace_id: str, vt: dict) -> tuple[list[int], np.ndarray]:
    from vllm import SamplingParams

    prompt = np.random.default_rng(7).integers(10, 500, P).tolist()
    params = SamplingParams(
        max_tokens=50, temperature=0.0, ignore_eos=True, extra_args={"vtoken": {**vt, "trace_id": trace_id, "salt": 3}}
    )
    out = llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)[0]
    ev = np.asarray(RequestTrace.read(d / f"{trace_id}.json").epochs[0].evicted_round)
    return list(out.outputs[0].token_ids), ev


CASES = {
    "h2o-generated": ({"policy": "h2o", "budget": 0.3, "scope": "generated"}, P),
    "scissorhands-generated": ({"policy": "scissorhands", "budget": 0.3, "scope": "generated"}, P),
    "tova-all-pool": ({"policy": "tova", "budget": 0.4, "scope": "all", "score_pool": 2}, 4 - 2),
    "h2o-all-sinks": ({"policy": "h2o", "budget": 0.4, "scope": "all", "sinks": 6}, 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_scores_from_the_first_evictable_slot_with_the_same_victims(case, engine, monkeypatch):
    from vtoken.vllm import scheduler
    from vtoken.vllm.scheduling import request_state

    llm, d = engine
    vt, first = CASES[case]
    seen: list[tuple[bool, int, int]] = []  # per scheduled step of the request: (scored, first, tokens)

    def spy(out, plan, _attach=scheduler.attach_plan):
        for rid, n in out.num_scheduled_tokens.items():
            rs = plan.requests.get(rid)  # None: nothing for the worker (no offset, no scores)
            seen.append((rs is not None and rs.scores, getattr(rs, "first", 0), n))
        return _attach(out, plan)

    monkeypatch.setattr(scheduler, "attach_plan", spy)
    tokens, ev = _generate(llm, d, f"sr-{case}", vt)
    assert np.any(ev >= 0), "nothing was evicted: the test would prove nothing"
    scored = [(f, n) for s, f, n in seen if s]
    assert scored and all(f == first for f, _ in scored), f"scored from {sorted({f for f, _ in scored})}"
    if vt["scope"] == "generated":  # the prefill chunks (n > 1) have nothing evictable: no score work at all
        assert all(n == 1 for _, n in scored) and sum(n > 1 for _, _, n in seen) == 3

    monkeypatch.setattr(request_state, "first_scored", lambda *a, **k: 0)  # the full range, as before
    seen.clear()
    full_tokens, full_ev = _generate(llm, d, f"sr-{case}-full", vt)
    assert all(f == 0 for s, f, _ in seen if s)
    assert tokens == full_tokens
    assert np.array_equal(ev, full_ev), "the scored range changed the victims"
