"""One way to give settings on the command line: ``--set vtoken.KEY=VALUE`` (``parse_sets`` / ``with_sets``,
``dataclasses.replace`` over the command's base config) and ``--budget`` through ``Budget.parse`` in every
command. The benchmarks are not run: their entry points are replaced by a recorder, so a test sees what the
command would pass down (issue 40: ``vtoken bench capacity --budget 512`` failed at parsing)."""

from __future__ import annotations

import pytest
from support.paths import RESULTS
from typer.testing import CliRunner

from vtoken.cli import app
from vtoken.core.config import Budget, Scope, VTokenConfig, parse_sets, with_sets
from vtoken.errors import ConfigError


class Reached(Exception):
    """Raised by the recorder in place of a benchmark: the command got past its parsing and validation."""


def recorder(calls: list):
    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise Reached

    return record


def invoke(*words: str):
    return CliRunner().invoke(app, list(words))


def test_with_sets_replaces_fields_with_typed_values():
    base = VTokenConfig(scope="all")
    cfg = with_sets(
        base,
        [
            "vtoken.budget=512",
            "vtoken.sinks=2",
            "vtoken.score_layers=null",
            "vtoken.keep_mass=0.9",
            "vtoken.scope=generated",
            "vtoken.sinks=3",
        ],
    )
    assert cfg.budget == Budget(count=512) and cfg.sinks == 3 and cfg.score_layers is None
    assert cfg.keep_mass == 0.9 and cfg.scope is Scope.GENERATED and cfg.recent == base.recent
    assert with_sets(base, []) is base
    assert parse_sets(["vtoken.budget=0.2"]) == {"budget": "0.2"}  # the budget parses its own text


@pytest.mark.parametrize(
    "item, needle",
    [
        ("vtoken.nope=1", "unknown key 'vtoken.nope'; valid keys: vtoken.policy, vtoken.budget"),
        ("sinks=2", "expected vtoken.KEY=VALUE"),
        ("vtoken.sinks", "expected vtoken.KEY=VALUE"),
        ("vtoken.sinks=x", "'vtoken.sinks=x': sinks must be an integer"),
        ("vtoken.sinks=-1", "sinks must be a non-negative integer, got -1"),
        ("vtoken.budget=2.0", "invalid budget '2.0'"),
        ("vtoken.mode=compact", "unknown reclamation mode 'compact'; valid modes"),
        ("vtoken.keep_mass=lots", "keep_mass must be a number or null"),
    ],
)
def test_a_bad_key_or_value_is_named(item, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        with_sets(VTokenConfig(), [item])


def config_reached(args, kwargs) -> VTokenConfig:
    """The one ``VTokenConfig`` a recorded bench entry point got: passed itself, held by the bench's setup
    (``vtoken``) or, for quality, its setup's base (``QualitySetup.base``)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, VTokenConfig):
            found.append(a)
        elif isinstance(getattr(a, "vtoken", None), VTokenConfig):
            found.append(a.vtoken)
        elif callable(getattr(a, "base", None)):
            found.append(a.base())
    assert len(found) == 1, f"not one config passed down: {args} {kwargs}"
    return found[0]


# every bench command that runs a vToken config: (its words, the module and entry point it hands the config to)
BENCHES = [
    (("capacity",), "vtoken.bench.engine.capacity", "main"),
    (("overhead",), "vtoken.bench.engine.overhead", "run_overhead"),
    (("prefix",), "vtoken.bench.engine.prefix", "run_prefix"),
    (("fleet",), "vtoken.bench.fleet.bench", "run_fleet"),
    (("sim-scale",), "vtoken.bench.engine.sim_scale", "run_sim_scale"),
    (("retained",), "vtoken.bench.engine.retained", "run_retained"),
    (("quality", "--quick", "--policies", "h2o", "--model", "tiny-llama"), "vtoken.bench.quality.bench", "run_quality"),
]


def run_bench(monkeypatch, words, module, entry, *more):
    """``vtoken bench WORDS MORE``, its entry point replaced by a recorder: the config it would run."""
    import importlib

    calls: list = []
    monkeypatch.setattr(importlib.import_module(module), entry, recorder(calls))
    result = invoke("bench", *words, *more)
    assert isinstance(result.exception, Reached), result.output
    ((args, kwargs),) = calls
    return config_reached(args, kwargs), args


@pytest.mark.parametrize("words, module, entry", BENCHES)
def test_bench_set_reaches_the_config_it_runs(monkeypatch, words, module, entry):
    cfg, _ = run_bench(monkeypatch, words, module, entry, "--set", "vtoken.sinks=8", "--set", "vtoken.recent=24")
    assert (cfg.sinks, cfg.recent) == (8, 24)
    default, _ = run_bench(monkeypatch, words, module, entry)
    assert (default.sinks, default.recent) == (VTokenConfig().sinks, VTokenConfig().recent)


@pytest.mark.parametrize("words, module, entry", BENCHES)
def test_bench_refuses_an_unknown_set_key_listing_the_valid_ones(monkeypatch, words, module, entry):
    import importlib

    calls: list = []
    monkeypatch.setattr(importlib.import_module(module), entry, recorder(calls))
    result = invoke("bench", *words, "--set", "vtoken.nope=1")
    assert result.exit_code == 2 and not calls
    assert "unknown key 'vtoken.nope'; valid keys: vtoken.policy, vtoken.budget" in result.output


@pytest.mark.parametrize(
    "words, key, named",
    [
        (("capacity",), "mode=naive", "--modes"),
        (("overhead",), "policy=h2o", "--policy"),
        (("overhead",), "score_layers=2", "--score-layers"),
        (("prefix",), "mode=naive", "--modes"),
        (("fleet",), "mode=naive", "--modes"),
        (("sim-scale",), "mode=naive", "every mode runs"),
        (("retained",), "budget=0.3", "--budgets"),
        (("quality", "--quick"), "trigger=block", "quality carries only"),
    ],
)
def test_bench_refuses_a_set_of_what_it_sets_itself(words, key, named):
    result = invoke("bench", *words, "--set", f"vtoken.{key}")
    assert result.exit_code == 2 and named in result.output, result.output


@pytest.mark.parametrize(
    "command, module, entry",
    [
        ("capacity", "vtoken.bench.engine.capacity", "main"),
        ("overhead", "vtoken.bench.engine.overhead", "run_overhead"),
        ("prefix", "vtoken.bench.engine.prefix", "run_prefix"),
        ("fleet", "vtoken.bench.fleet.bench", "run_fleet"),
        ("sim-scale", "vtoken.bench.engine.sim_scale", "run_sim_scale"),
    ],
)
def test_bench_budget_takes_a_token_count_and_sets_go_over_flags(monkeypatch, command, module, entry):
    cfg, _ = run_bench(monkeypatch, (command,), module, entry, "--budget", "512")
    assert cfg.budget == Budget(count=512)
    cfg, _ = run_bench(monkeypatch, (command,), module, entry, "--budget", "512", "--set", "vtoken.budget=24")
    assert cfg.budget == Budget(count=24)
    result = invoke("bench", command, "--budget", "0")
    assert result.exit_code == 2 and "invalid budget '0'" in result.output


def test_bench_engines_are_built_from_the_config_passed_down(monkeypatch):
    """The config a command passes down is the one its engine gets: capacity's setup, overhead's engines (each
    variant's mode and policy over it), fleet's simulated replicas."""
    import dataclasses

    from vtoken.bench.engine import capacity, overhead
    from vtoken.bench.fleet import model as fleet_model

    cfg, (setup, *_) = run_bench(
        monkeypatch,
        ("capacity",),
        "vtoken.bench.engine.capacity",
        "main",
        "--set",
        "vtoken.sinks=8",
        "--block-size",
        "64",
    )
    assert setup.to_report()["sinks"] == 8 and setup.to_report()["block_size"] == 64
    got: list = []
    monkeypatch.setattr("vtoken.vllm.engine_kwargs", lambda c, **k: got.append(c) or {})
    monkeypatch.setattr("vllm.LLM", lambda **k: k)
    capacity.build_engine(setup)
    overhead._engine("m", dataclasses.replace(cfg, mode="naive", policy="h2o"), "auto", 64)
    assert [(c.sinks, c.block_size) for c in got] == [(8, 64), (8, 64)] and got[1].policy == "h2o"
    profiles = fleet_model.kv_profiles(
        fleet_model.WORKLOAD[:1], dataclasses.replace(fleet_model.BASE, sinks=8), requests=2
    )
    assert profiles["naive"][0].held.size == fleet_model.WORKLOAD[0].gen


def test_retained_cells_share_the_set_and_keep_their_own():
    from vtoken.bench.engine.retained import BASE, grid
    from vtoken.bench.settings import configure
    from vtoken.sim.run import SimConfig

    base = SimConfig(vtoken=configure(BASE, ["vtoken.sinks=8"], recent=24), prompt_len=64, gen_len=8, requests=2)
    cells = grid(base, "h2o,tova", "0.2,512", "16,32")
    assert len(cells) == 8 and {(c.vtoken.sinks, c.vtoken.recent) for c in cells} == {(8, 24)}
    assert {c.vtoken.budget for c in cells} == {Budget(fraction=0.2), Budget(count=512)}


def test_quality_set_sets_the_engine_or_one_value_in_every_point(monkeypatch):
    import vtoken.bench.quality.bench as quality

    words = ("quality", "--quick", "--policies", "h2o,tova", "--model", "tiny-llama")
    cfg, (setup,) = run_bench(
        monkeypatch,
        words,
        "vtoken.bench.quality.bench",
        "run_quality",
        "--set",
        "vtoken.scope=generated",
        "--set",
        "vtoken.budget=512",
        "--set",
        "vtoken.block_size=64",
    )
    assert setup.scopes == ("generated",) and setup.budgets == (512,) and setup.block_size == 64 == cfg.block_size
    assert {pt.config(setup.base()).block_size for pt in quality.points(setup)} == {64}
    assert setup.policies == ("h2o", "tova")


def test_simulate_takes_sets_over_its_flags():
    import json

    from vtoken.sim.run import SimConfig

    result = invoke(
        "simulate",
        "--requests",
        "2",
        "--prompt-len",
        "64",
        "--gen-len",
        "8",
        "--budget",
        "512",
        "--set",
        "vtoken.sinks=2",
        "--set",
        "vtoken.budget=24",
        "--json",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["sinks"] == 2 and out["budget"] == 24
    default = json.loads(invoke("simulate", "--requests", "2", "--prompt-len", "64", "--gen-len", "8", "--json").stdout)
    base = SimConfig().vtoken  # the flags' defaults are SimConfig's, not copies
    assert (
        default["policy"],
        default["budget"],
        default["block_size"],
        default["sinks"],
        default["recent"],
        default["trigger"],
        default["granularity"],
    ) == (base.policy, base.budget.to_json(), base.block_size, base.sinks, base.recent, base.trigger, base.granularity)
    assert invoke("simulate", "--set", "vtoken.mode=naive").exit_code == 2
    bad = invoke("simulate", "--set", "vtoken.nope=1")
    assert bad.exit_code == 2 and "unknown key 'vtoken.nope'" in bad.output


def test_verify_takes_sets_it_carries_and_refuses_the_others(monkeypatch):
    import vtoken.vllm.offline.verify_cli as verify_cli

    calls: list = []
    monkeypatch.setattr(verify_cli, "run_cases", recorder(calls))
    result = invoke("verify", "--budget", "512", "--set", "vtoken.sinks=2", "--set", "vtoken.mode=naive")
    assert isinstance(result.exception, Reached), result.output
    ((args, kwargs),) = calls
    cases = args[2]
    assert [(c.mode, c.budget) for c in cases] == [("naive", 512), ("repack", 512)] and kwargs["sinks"] == 2
    result = invoke("verify", "--set", "vtoken.scope=all")
    assert result.exit_code == 2 and "verify carries only" in result.output


def test_quality_points_are_overrides_of_one_base_config():
    import dataclasses

    from vtoken.bench.quality.bench import BASE, FULL, SETTING_DEFAULTS, Point, QualitySetup
    from vtoken.core.config import Mode

    pt = Point("tova", "block", 512, prompt_tail=8, scope="generated")
    assert pt.config() == dataclasses.replace(
        BASE, policy="tova", granularity="block", budget=512, prompt_tail=8, scope="generated", mode="naive"
    )
    assert Point("h2o", "token", 0.2).config().mode is Mode.REPACK
    assert FULL.config().mode is Mode.NONE and FULL.config().budget == BASE.budget
    settings = {k: v for k, v in SETTING_DEFAULTS.items() if k not in ("policy", "granularity")}
    assert settings == {k: BASE.to_dict()[k] for k in settings}  # older reports' defaults are BASE's
    assert (QualitySetup.sinks, QualitySetup.recent, QualitySetup.block_size) == (
        BASE.sinks,
        BASE.recent,
        BASE.block_size,
    )


def test_quality_refuses_a_bad_point_before_any_engine(monkeypatch):
    import vtoken.bench.quality.bench as quality
    from vtoken.bench.quality.presets import QUALITY_PRESETS

    assert QUALITY_PRESETS["quick"].ruler_tasks == "niah_single_1" and QUALITY_PRESETS["full"].policies == "all"
    calls: list = []
    monkeypatch.setattr(quality, "run_quality", recorder(calls))
    result = invoke(
        "bench", "quality", "--quick", "--policies", "h2o", "--granularities", "block", "--keep-masses", "0.9"
    )
    assert result.exit_code == 2 and "keep_mass evicts single tokens" in result.output and not calls
    result = invoke("bench", "quality", "--quick", "--policies", "h2o", "--budgets", "512", "--model", "tiny-llama")
    assert isinstance(result.exception, Reached), result.output
    (setup,), _ = calls[0]
    assert setup.budgets == (512,) and setup.ruler_samples == QUALITY_PRESETS["quick"].ruler_samples


@pytest.mark.parametrize("command", ["longgen", "codegen"])
def test_a_point_with_an_unknown_key_is_refused_listing_the_valid_ones(command):
    result = invoke("bench", command, "--point", "scope=all,nope=1")
    assert result.exit_code == 2
    assert "point 'scope=all,nope=1': 'nope=1': unknown key 'nope'; valid keys: policy, budget" in result.output
    result = invoke("bench", command, "--point", "sinks=x")
    assert result.exit_code == 2 and "point 'sinks=x': 'sinks=x': sinks must be an integer" in result.output


def test_points_are_read_as_sets_are():
    from vtoken.bench.quality.longgen.cli import parse_point

    label, cfg = parse_point("scope=all,budget=512,score_layers=null,keep_mass=0.9")
    assert label == "scope=all,budget=512,score_layers=null,keep_mass=0.9"
    assert cfg == with_sets(
        VTokenConfig(), ["vtoken.scope=all", "vtoken.budget=512", "vtoken.score_layers=null", "vtoken.keep_mass=0.9"]
    )
    assert parse_point("default") == ("default", VTokenConfig())
    for bad, needle in [
        ("budget", "is not key=value"),
        ("block_size=64", "block_size is the engine's"),
        ("budget=2.0", "invalid budget '2.0'"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_point(bad)


def test_every_committed_point_still_reads_as_the_settings_it_ran():
    """The committed longgen and codegen reports' points parse to the settings each report records."""
    import json

    from vtoken.bench.quality.longgen.cli import parse_point

    results = RESULTS
    checked = 0
    for path in sorted(results.glob("*.json")):
        report = json.loads(path.read_text())
        if report.get("bench") not in ("longgen", "codegen"):
            continue
        for point in report["points"]:
            ran = point["settings"]
            now = parse_point(point["label"])[1].to_dict()
            assert {k: now[k] for k in ran if k != "block_size"} == {
                k: v for k, v in ran.items() if k != "block_size"
            }, (path.name, point)
            checked += 1
    assert checked
