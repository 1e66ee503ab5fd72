"""The trade per model (``vtoken.bench.quality.longgen.trade``): yardstick points and served runs matched by setting,
capacity gain from blocks, the gain at parity, and the figure from the committed files."""

from __future__ import annotations

import json

import pytest
from support.paths import RESULTS

from vtoken.bench.quality.longgen import trade

SERVED = [
    RESULTS / f
    for f in (
        "serve-smollm2-32-blocks-stock-median.json",
        "serve-smollm2-64-blocks-stock-median.json",
        "serve-smollm2-decode-only-10.json",
    )
]


def _load(paths):
    return [json.loads(p.read_text()) for p in paths]


def test_a_served_run_names_its_setting_and_scope_defaults_to_all():
    decode_only, every_token = _load(SERVED[2:]), _load(SERVED[:1])
    assert trade.served_settings(decode_only[0]) == {"policy": "h2o", "budget": 0.1, "scope": "generated"}
    assert trade.served_settings(every_token[0]) == {"policy": "h2o", "budget": 0.2, "scope": "all"}


def test_served_gains_are_the_repack_over_stock_medians_with_their_spread():
    (g,) = trade.served_gains(_load(SERVED[:1]))
    ratio = _load(SERVED[:1])[0]["summary"]["ratios"]["repack/h2o +admission / none"]["max_rate_at_target"]
    assert (g["median"], g["low"], g["high"]) == (ratio["median"], ratio["min"], ratio["max"])
    assert g["pool_blocks"] == 32


def test_capacity_gain_is_full_blocks_over_held_blocks():
    (report,) = _load([RESULTS / "longgen-smollm2-224.json"])
    full = report["full_cache"]["blocks_mean"]
    for p, q in zip(trade.text_points([report]), report["points"]):
        assert p["gain"] == pytest.approx(full / q["retained_blocks_mean"])
        assert p["at_parity"] == q["verdict"]["at_parity"]


def test_the_gain_at_parity_counts_only_points_at_parity():
    points = [
        {
            "label": "a",
            "settings": {"policy": "h2o", "budget": 0.95, "scope": "generated"},
            "gain": 1.03,
            "at_parity": True,
        },
        {
            "label": "b",
            "settings": {"policy": "h2o", "budget": 0.1, "scope": "generated"},
            "gain": 2.5,
            "at_parity": False,
        },
    ]
    served = [{"settings": {"policy": "h2o", "budget": 0.1, "scope": "generated"}, "median": 2.0}]
    assert trade.gain_at_parity(points, served) == {
        "capacity_gain": 1.03,
        "served_gain": 1.0,
        "points_at_parity": ["a"],
    }
    points[1]["at_parity"] = True
    assert trade.gain_at_parity(points, served)["served_gain"] == 2.0


def test_the_trade_figure_renders_from_the_committed_reports(tmp_path):
    from vtoken.bench.quality.longgen.plot import plot_trade

    out = tmp_path / "trade.png"
    plot_trade(
        _load([RESULTS / "longgen-smollm2-224.json"]),
        _load(sorted(RESULTS.glob("codegen-smollm2*.json"))),
        _load(SERVED),
        out,
    )
    assert out.stat().st_size > 10_000
