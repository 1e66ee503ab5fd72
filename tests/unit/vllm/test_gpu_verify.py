"""``vtoken verify --gpu`` (vtoken/vllm/offline/gpu_verify.py): what can be checked without CUDA — the refusal off CUDA,
the production path's engine options, the sync-check environment, and the verdicts on paired runs."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.core.config import VTokenConfig
from vtoken.errors import ConfigError
from vtoken.vllm.offline import gpu_verify as gv
from vtoken.vllm.scheduling.trace import NEVER, RequestTrace


def test_off_cuda_the_command_refuses_before_building_an_engine():
    from typer.testing import CliRunner

    from vtoken.cli import app

    res = CliRunner().invoke(app, ["verify", "--gpu", "--budget", "0.3"])
    assert res.exit_code == 2
    assert "verify --gpu needs vLLM's CUDA platform; this vLLM runs on 'cpu'" in res.output
    with pytest.raises(ConfigError, match="'cpu'"):
        gv.require_cuda("cpu")
    gv.require_cuda("cuda")


def test_the_production_path_is_bf16_with_graphs_and_stock_has_no_vtoken_class():
    cfg = VTokenConfig(policy="h2o", budget=0.3, mode="repack", block_size=32)
    ours, stock = gv.production_kwargs(cfg, "/tmp/t", 256), gv.production_kwargs(None, None, 256)
    for kw in (ours, stock):
        assert kw["dtype"] == "bfloat16" and "enforce_eager" not in kw and not kw["enable_prefix_caching"]
    assert ours["scheduler_cls"].startswith("vtoken.") and ours["worker_cls"].startswith("vtoken.")
    assert not {"scheduler_cls", "worker_cls", "additional_config"} & set(stock)


def test_engines_are_built_with_vllms_sync_check_set_to_error():
    import vllm.envs as envs

    from vtoken.vllm.offline.launch import scoped_env

    env = gv.gpu_env()
    with scoped_env(**env):
        assert envs.VLLM_GPU_SYNC_CHECK == "error"  # a value vLLM 0.32 accepts (env_with_choices)


def test_paired_runs_pass_when_equal_or_parting_at_a_near_tie_only():
    a, lp, gap = [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [1.0, 1.0, 0.01, 1.0]
    same = gv.compare_paired(a, lp, gap, a, lp, gap)
    assert same.ok and same.tokens_equal and same.first_divergence is None and same.max_abs_logprob_diff == 0
    tie = gv.compare_paired(a, lp, gap, [5, 6, 9, 8], [-0.1, -0.25, -0.3, -0.4], [1.0, 1.0, 0.02, 1.0])
    assert tie.ok and not tie.tokens_equal and tie.first_divergence == 2 and tie.near_tie
    assert tie.max_abs_logprob_diff == pytest.approx(0.05)
    clear = gv.compare_paired(a, lp, gap, [5, 9, 7, 8], lp, gap)
    assert not clear.ok and clear.first_divergence == 1


def _trace(evicted_round: list[int]) -> RequestTrace:
    t = RequestTrace(
        request_id="r", trace_id=None, policy="h2o", mode="repack", budget="0.3", block_size=32, prompt_len=4
    )
    ep = t.new_epoch(0)
    ep.place(0, len(evicted_round), 0)
    ep.evict(np.flatnonzero(np.asarray(evicted_round) != NEVER), 0)
    ep.evicted_round[:] = evicted_round
    return t


def test_evicted_sets_are_compared_round_by_round_up_to_the_divergence():
    a = _trace([NEVER, 3, 5, NEVER])
    assert gv.evicted_sets_equal(a, _trace([NEVER, 3, 5, NEVER]), steps=10)
    assert not gv.evicted_sets_equal(a, _trace([NEVER, 4, 5, NEVER]), steps=10)
    assert gv.evicted_sets_equal(a, _trace([NEVER, 3, 7, NEVER]), steps=5)  # after step 5 they may part


def test_the_divergence_is_located_in_trace_rounds():
    t = RequestTrace(
        request_id="r", trace_id=None, policy="h2o", mode="repack", budget="0.3", block_size=32, prompt_len=4
    )
    ep = t.new_epoch(0)
    ep.place(0, 4, 0)  # the prompt in round 0, then one generated token per round
    for k in range(3):
        ep.place(4 + k, 1, 1 + k)
    assert gv.rounds_before(t, 4, 2) == 3
    assert gv.rounds_before(t, 4, None) > 10**9
