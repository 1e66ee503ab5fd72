"""One way to give settings on the command line: ``--set vtoken.KEY=VALUE`` (``parse_sets`` / ``with_sets``,
``dataclasses.replace`` over the command's base config) and ``--budget`` through ``Budget.parse`` in every
command. The benchmarks are not run: their entry points are replaced by a recorder, so a test sees what the
command would pass down (issue 40: ``vtoken bench capacity --budget 512`` failed at parsing)."""

from __future__ import annotations

import pytest
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
    cfg = with_sets(base, ["vtoken.budget=512", "vtoken.sinks=2", "vtoken.score_layers=null",
                           "vtoken.keep_mass=0.9", "vtoken.scope=generated", "vtoken.sinks=3"])
    assert cfg.budget == Budget(count=512) and cfg.sinks == 3 and cfg.score_layers is None
    assert cfg.keep_mass == 0.9 and cfg.scope is Scope.GENERATED and cfg.recent == base.recent
    assert with_sets(base, []) is base
    assert parse_sets(["vtoken.budget=0.2"]) == {"budget": "0.2"}  # the budget parses its own text


@pytest.mark.parametrize("item, needle", [
    ("vtoken.nope=1", "unknown key 'vtoken.nope'; valid keys: vtoken.policy, vtoken.budget"),
    ("sinks=2", "expected vtoken.KEY=VALUE"),
    ("vtoken.sinks", "expected vtoken.KEY=VALUE"),
    ("vtoken.sinks=x", "'vtoken.sinks=x': sinks must be an integer"),
    ("vtoken.sinks=-1", "sinks must be a non-negative integer, got -1"),
    ("vtoken.budget=2.0", "invalid budget '2.0'"),
    ("vtoken.mode=compact", "unknown reclamation mode 'compact'; valid modes"),
    ("vtoken.keep_mass=lots", "keep_mass must be a number or null"),
])
def test_a_bad_key_or_value_is_named(item, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        with_sets(VTokenConfig(), [item])


@pytest.mark.parametrize("command, module, entry", [
    ("capacity", "vtoken.bench.capacity", "main"),
    ("overhead", "vtoken.bench.overhead", "overhead"),
    ("prefix", "vtoken.bench.prefix", "prefix"),
    ("fleet", "vtoken.bench.fleet", "run_fleet"),
])
def test_bench_budget_takes_a_token_count(monkeypatch, command, module, entry):
    import importlib

    calls: list = []
    monkeypatch.setattr(importlib.import_module(module), entry, recorder(calls))
    result = invoke("bench", command, "--budget", "512")
    assert isinstance(result.exception, Reached), result.output
    (args, kwargs), = calls
    passed = [a for a in (*args, *kwargs.values()) if a == 512 or getattr(a, "budget", None) == 512]
    assert passed, f"--budget 512 not passed down as 512: {args} {kwargs}"
    result = invoke("bench", command, "--budget", "0")
    assert result.exit_code == 2 and "invalid budget '0'" in result.output


def test_simulate_takes_sets_over_its_flags():
    import json

    result = invoke("simulate", "--requests", "2", "--prompt-len", "64", "--gen-len", "8", "--budget", "512",
                    "--set", "vtoken.sinks=2", "--set", "vtoken.budget=24", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["sinks"] == 2 and out["budget"] == 24
    assert invoke("simulate", "--set", "vtoken.mode=naive").exit_code == 2
    bad = invoke("simulate", "--set", "vtoken.nope=1")
    assert bad.exit_code == 2 and "unknown key 'vtoken.nope'" in bad.output


def test_verify_takes_sets_it_carries_and_refuses_the_others(monkeypatch):
    import vtoken.vllm.verify_cli as verify_cli

    calls: list = []
    monkeypatch.setattr(verify_cli, "run_cases", recorder(calls))
    result = invoke("verify", "--budget", "512", "--set", "vtoken.sinks=2", "--set", "vtoken.mode=naive")
    assert isinstance(result.exception, Reached), result.output
    (args, kwargs), = calls
    cases = args[2]
    assert [(c.mode, c.budget) for c in cases] == [("naive", 512), ("repack", 512)] and kwargs["sinks"] == 2
    result = invoke("verify", "--set", "vtoken.scope=all")
    assert result.exit_code == 2 and "verify carries only" in result.output


def test_quality_points_are_overrides_of_one_base_config():
    import dataclasses

    from vtoken.bench.quality import BASE, FULL, SETTING_DEFAULTS, Point, QualitySetup
    from vtoken.core.config import Mode

    pt = Point("tova", "block", 512, prompt_tail=8, scope="generated")
    assert pt.config() == dataclasses.replace(BASE, policy="tova", granularity="block", budget=512, prompt_tail=8,
                                              scope="generated", mode="naive")
    assert Point("h2o", "token", 0.2).config().mode is Mode.REPACK
    assert FULL.config().mode is Mode.NONE and FULL.config().budget == BASE.budget
    settings = {k: v for k, v in SETTING_DEFAULTS.items() if k not in ("policy", "granularity")}
    assert settings == {k: BASE.to_dict()[k] for k in settings}  # older reports' defaults are BASE's
    assert (QualitySetup.sinks, QualitySetup.recent, QualitySetup.block_size) == (BASE.sinks, BASE.recent,
                                                                                   BASE.block_size)


def test_quality_refuses_a_bad_point_before_any_engine(monkeypatch):
    import vtoken.bench.quality as quality
    from vtoken.bench.cli import QUALITY_PRESETS

    assert QUALITY_PRESETS["quick"].ruler_tasks == "niah_single_1" and QUALITY_PRESETS["full"].policies == "all"
    calls: list = []
    monkeypatch.setattr(quality, "run_quality", recorder(calls))
    result = invoke("bench", "quality", "--quick", "--policies", "h2o", "--granularities", "block",
                    "--keep-masses", "0.9")
    assert result.exit_code == 2 and "keep_mass evicts single tokens" in result.output and not calls
    result = invoke("bench", "quality", "--quick", "--policies", "h2o", "--budgets", "512", "--model", "tiny-llama")
    assert isinstance(result.exception, Reached), result.output
    (setup,), _ = calls[0]
    assert setup.budgets == (512,) and setup.ruler_samples == QUALITY_PRESETS["quick"].ruler_samples
