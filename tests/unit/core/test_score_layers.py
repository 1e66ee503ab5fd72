"""``score_layers``: only a subset of the attention layers feeds the attention statistics (issue 9).

Which layers (``score_layer_indices``), validation everywhere the setting enters (engine, request, serving
config, CLIs), the step's accumulator groups (``LayerGroups``: an unscored layer never reaches the group's
accumulator, the mean is over the scored layers), the runner's grouping of a step's requests and its layer
order. The engine test (the real scheduler → worker path) is in tests/integration/test_vllm_engine.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.quality import small_quality_setup

from vtoken.core.config import DEFAULT_SCORE_LAYERS, VTokenConfig, score_layer_indices
from vtoken.errors import ConfigError
from vtoken.kernels.backend_check import fill_random
from vtoken.kernels.gpu_layout import PagedScoreAccumulator, allocate_kv_caches, layout_for, read_k
from vtoken.kernels.scores import LayerGroups, RequestScores, attention_probs


@pytest.mark.parametrize(
    "count,depth,want",
    [
        (None, 30, tuple(range(30))),
        (30, 30, tuple(range(30))),
        (31, 30, tuple(range(30))),
        (1, 30, (29,)),
        (2, 30, (14, 29)),
        (3, 30, (9, 19, 29)),
        (4, 30, (7, 14, 22, 29)),
        (1, 1, (0,)),
        (1, 2, (1,)),
        (2, 2, (0, 1)),
    ],
)
def test_score_layer_indices(count, depth, want):
    assert score_layer_indices(count, depth) == want


def test_score_layer_indices_are_evenly_spread_and_end_at_the_last():
    for depth in range(1, 41):
        for count in range(1, depth + 1):
            got = score_layer_indices(count, depth)
            assert len(got) == count and len(set(got)) == count and got == tuple(sorted(got))
            assert got[-1] == depth - 1 and got[0] >= 0
            gaps = np.diff((-1, *got))
            assert gaps.max() - gaps.min() <= 1, (count, depth, got)  # as even as integers allow
    with pytest.raises(ValueError):
        score_layer_indices(0, 30)


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "3"])
def test_bad_score_layers_name_the_value(bad):
    from vtoken.vllm.config import EngineSettings, request_settings

    with pytest.raises(ConfigError, match=f"score_layers must be a positive integer .*got {bad!r}"):
        VTokenConfig(score_layers=bad)
    with pytest.raises(ConfigError, match=f"got {bad!r}"):
        EngineSettings.from_additional_config({"vtoken": {"score_layers": bad}}, 32)
    engine = EngineSettings.from_additional_config({"vtoken": {"score_layers": 4}}, 32)
    with pytest.raises(ConfigError, match=f"got {bad!r}"):
        request_settings(engine, {"vtoken": {"score_layers": bad}})


def test_score_layers_flows_through_engine_request_and_serving_config():
    from pydantic import ValidationError

    from vtoken.serve.config import ServeAppConfig
    from vtoken.vllm.config import EngineSettings, request_settings

    assert VTokenConfig().score_layers == DEFAULT_SCORE_LAYERS == 1  # default: the last layer (measured, issue 9)
    everything = EngineSettings.from_additional_config({"vtoken": {"score_layers": None}}, 32)
    assert everything.cfg.score_layers is None  # null: every layer, also through the round trip
    again = EngineSettings.from_additional_config({"vtoken": everything.to_additional_config()}, 32)
    assert again.cfg.score_layers is None
    assert ServeAppConfig.model_validate({"vtoken": {"score_layers": None}}).vtoken.score_layers is None
    assert ServeAppConfig.model_validate({}).vtoken.score_layers == DEFAULT_SCORE_LAYERS
    from vtoken.vllm import engine_kwargs

    sent = engine_kwargs(VTokenConfig(score_layers=None))["additional_config"]["vtoken"]
    assert "score_layers" in sent and sent["score_layers"] is None  # reaches the engine as null, not dropped
    engine = EngineSettings.from_additional_config({"vtoken": {"score_layers": 4}}, 32)
    assert engine.cfg.score_layers == 4
    again = EngineSettings.from_additional_config({"vtoken": engine.to_additional_config()}, 32)
    assert again.cfg.score_layers == 4
    assert request_settings(engine, None).cfg.score_layers == 4
    assert request_settings(engine, {"vtoken": {"score_layers": 2}}).cfg.score_layers == 2
    assert request_settings(engine, {"vtoken.score_layers": None}).cfg.score_layers is None
    assert VTokenConfig.from_dict(VTokenConfig(score_layers=3).to_dict()).score_layers == 3
    assert ServeAppConfig.model_validate({"vtoken": {"score_layers": 6}}).vtoken.score_layers == 6
    with pytest.raises(ValidationError, match="score_layers must be a positive integer.*got 0"):
        ServeAppConfig.model_validate({"vtoken": {"score_layers": 0}})


def test_clis_refuse_a_bad_score_layers_before_any_engine():
    from typer.testing import CliRunner

    from vtoken.cli import app

    runner = CliRunner()
    for args in (
        ["bench", "overhead", "--score-layers", "0"],
        ["verify", "--score-layers", "-1"],
        ["bench", "quality", "--quick", "--score-layers", "all,0"],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "score_layers must be a positive integer" in res.output, (args, res.output)


def test_quality_points_carry_score_layers():
    from vtoken.bench.quality.bench import Point, QualitySetup, points

    setup = small_quality_setup(score_layers=(None, 4))
    pts = points(setup)
    assert [p.key for p in pts[1:]] == ["h2o_token_0.2", "h2o_token_0.2@4"]
    assert pts[2].extra("t", 1)["vtoken"]["score_layers"] == 4
    assert pts[1].extra("t", 1)["vtoken"]["score_layers"] is None  # every layer, said explicitly (default: fewer)
    default = dataclasses.replace(setup, score_layers=QualitySetup.score_layers)
    assert [p.score_layers for p in points(default)[1:]] == [DEFAULT_SCORE_LAYERS]  # the bench measures the default
    assert Point("h2o", "token", 0.2).score_layers is None


def _request(name: str, q0: int, q1: int) -> RequestScores:
    return RequestScores(q0, q1, 40, torch.tensor([4, 1, 3]), want_attention=True, want_key_norm=False)


def test_layer_groups_score_only_their_layers_and_average_over_them():
    """Two requests on the same row and queries: "all" scores every layer, "sub" only layers {1, 2} of 3. A
    layer outside the set never reaches that group's accumulator, and each mean is over its own layers."""
    views = allocate_kv_caches("cpu", 3, 6, 16, 2, 32, torch.float32)
    fill_random(views, 5)
    layout = layout_for("cpu", views[0])
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(6))
    whole, sub = PagedScoreAccumulator(layout), PagedScoreAccumulator(layout)
    whole.requests["all"], sub.requests["sub"] = _request("all", 0, 1), _request("sub", 1, 2)
    groups = LayerGroups([(None, whole), (frozenset({1, 2}), sub)])
    seen = []
    sub_add = sub.add_layer
    sub.add_layer = lambda *a: (seen.append(len(seen)), sub_add(*a))
    for i, view in enumerate(views):
        groups.add_layer(q * (1 + i), None, view, 0.2, layer=i)
    assert len(seen) == 2  # layer 0 never reached the subset's accumulator
    assert groups.requests["all"].layers == 3 and groups.requests["sub"].layers == 2
    slots = torch.tensor([4 * 16 + j for j in range(16)] + [16 + j for j in range(16)] + [48 + j for j in range(8)])

    def probs(i: int, qi: int) -> np.ndarray:
        keys = read_k(views[i], layout, slots)
        return attention_probs((q * (1 + i))[qi : qi + 1], keys, 0.2)[0].double().numpy()

    out = groups.finish()
    assert np.allclose(out["all"].accumulated, sum(probs(i, 0) for i in range(3)) / 3, atol=1e-6)
    assert np.allclose(out["sub"].accumulated, (probs(1, 1) + probs(2, 1)) / 2, atol=1e-6)
    attention, norms = groups.linear_buffers()  # group by group, in the plan's order (TP: same on every rank)
    assert len(attention) == 2 and attention[0] is whole.requests["all"].probs and not norms


def test_runner_groups_a_steps_requests_by_their_layer_subset():
    """``_vt_collect``: one accumulator per distinct subset (None, counts ≥ depth → every layer), every-layer
    group first, then by the subsets' layers — the same order on every TP rank."""
    from vtoken.vllm.runner.mixin import VTokenRunnerMixin
    from vtoken.vllm.transport import RequestStep, StepPlan

    class Runner(VTokenRunnerMixin):
        def _vt_make_accumulator(self, layout):
            return PagedScoreAccumulator(layout)

    r = Runner()
    r._vt_depth, r._vt_layout = 30, None
    r.optimistic_seq_lens_cpu = torch.full((5,), 40)
    rows = SimpleNamespace(
        num_blocks_per_row=np.full(5, 2), block_table=SimpleNamespace(np=np.zeros((5, 4), int)), block_size=32
    )
    counts = {"a": 3, "b": None, "c": 30, "d": 1, "e": 3}
    plan = StepPlan(
        src=np.zeros(0, np.int64),
        dst=np.zeros(0, np.int64),
        requests={k: RequestStep(offset=0, scores=True, score_layers=n) for k, n in counts.items()},
    )
    r._vt_collect(plan, list(counts), np.arange(6), rows)
    got = [(None if s is None else sorted(s), sorted(acc.requests)) for s, acc in r._vt_acc.groups]
    assert got == [(None, ["b", "c"]), ([9, 19, 29], ["a", "e"]), ([29], ["d"])]


def test_forward_order_reads_the_layer_index_from_the_name():
    from vtoken.vllm.runner.mixin import _forward_order

    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert _forward_order(names) == [2, 1, 0]
    assert _forward_order(["l0", "l1"]) == [0, 1]
