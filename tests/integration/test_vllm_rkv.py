"""R-KV in vLLM's engine (CPU, in-process, tiny random Llama): the worker measures ``redundancy`` over the live
keys of every scored step and the scheduler folds it in; only requests whose policy reads it pay for it. The
fidelity of its decisions (== the paired naive run == the HF masked reference) is in test_vllm_engine.py's
matrix (``POLICIES``)."""

from __future__ import annotations

import numpy as np
import pytest

import vtoken.vllm.scheduler as scheduler_module
from vtoken.vllm.offline.launch import start_engine

pytestmark = pytest.mark.slow


def test_the_worker_measures_redundancy_over_the_live_keys(tmp_path, monkeypatch):
    from vllm import SamplingParams

    from vtoken.models.tiny import tiny_model

    seen: dict[str, list] = {}
    observe = scheduler_module.observe

    def recording(table, scores, question_aware=False):
        observe(table, scores)
        rid = next(r for r, st in llm_sched._vt_reqs.items() if st.table is table)
        seen.setdefault(rid[0], []).append((scores, table.live_logicals(), table.redundancy.copy()))

    monkeypatch.setattr(scheduler_module, "observe", recording)
    llm = start_engine(str(tiny_model("llama")), 32, str(tmp_path))
    from vtoken.vllm.offline.launch import scheduler_of

    llm_sched = scheduler_of(llm)
    rng = np.random.default_rng(5)
    prompt = rng.integers(10, 500, 120).tolist()
    try:
        for rid, policy in (("r", "rkv"), ("h", "h2o")):
            params = SamplingParams(
                max_tokens=16,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"vtoken": {"policy": policy, "budget": 0.3, "trace_id": rid}},
            )
            llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            while llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert set(seen) == {"r", "h"}, list(seen)  # (vLLM may suffix request ids: keyed by the first letter)
    assert len(seen["r"]) == 16 and len(seen["h"]) == 16  # the prompt's step, then every decode step
    for scores, _live, table_red in seen["r"]:
        red = scores.redundancy
        assert red is not None and red.shape == scores.logicals.shape
        assert np.all(np.abs(red) <= 1 + 1e-6) and np.ptp(red) > 0
        # the step's keys were the live ones: its values are set, every other token's cleared
        np.testing.assert_array_equal(table_red[scores.logicals], red)
        assert np.all(table_red[np.setdiff1d(np.arange(len(table_red)), scores.logicals)] == 0)
    assert seen["r"][-1][1].size < 120  # it evicted
    assert all(scores.redundancy is None for scores, _, _ in seen["h"])  # H2O does not collect it
