"""The settings tables are derived, not copied: each ``VTokenConfig`` / ``EngineSettings`` field carries its
documentation as an attribute docstring, ``vtoken settings`` renders the table (key, default, meaning) from the
fields, and the docs that include it (``SETTINGS_DOCS``) hold exactly the rendered table. Pure file reading."""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum

import pytest
from support.paths import ROOT
from typer.testing import CliRunner

from vtoken.core.config import VTokenConfig
from vtoken.core.settings_doc import attribute_docs, settings_rows, settings_table, sync
from vtoken.vllm.config import SETTINGS_DOCS, EngineSettings, settings_tables


@pytest.mark.parametrize("doc", SETTINGS_DOCS)
def test_the_committed_docs_hold_the_generated_settings_tables(doc):
    text = (ROOT / doc).read_text()
    assert "<!-- settings:begin " in text and "<!-- settings:end -->" in text, f"{doc} includes no settings table"
    assert sync(text, settings_tables()) == text, f"{doc}: settings table is stale; run `make docs`"


def test_every_setting_is_documented_under_its_field():
    assert tuple(attribute_docs(VTokenConfig)) == VTokenConfig.keys()
    own = tuple(f.name for f in dataclasses.fields(EngineSettings) if f.name != "cfg")
    assert tuple(attribute_docs(EngineSettings)) == own


def test_every_value_of_a_choice_is_named_in_its_docstring():
    docs, hints = attribute_docs(VTokenConfig), typing.get_type_hints(VTokenConfig)
    choices = {name: hint for name, hint in hints.items() if isinstance(hint, type) and issubclass(hint, Enum)}
    assert {"mode", "scope", "trigger", "granularity", "prompt_scores"} <= set(choices)
    for name, enum in choices.items():
        missing = [m.value for m in enum if f"`{m.value}`" not in docs[name]]
        assert not missing, f"VTokenConfig.{name}'s docstring names no {missing}"


def test_the_table_states_the_dataclass_defaults():
    rows = {name: default for name, default, _ in settings_rows(VTokenConfig, prefix="vtoken.")}
    assert rows["`vtoken.budget`"] == "`1.0`" and rows["`vtoken.scope`"] == "`generated`"
    assert rows["`vtoken.keep_mass`"] == "`null`" and rows["`vtoken.score_layers`"] == "`1`"
    engine = {name: default for name, default, _ in settings_rows(EngineSettings, skip=("cfg",))}
    assert engine["`check`"] == "`false`" and engine["`invariant_period`"] == "`1024`"


def test_a_stale_or_unknown_table_is_caught():
    table = settings_table([("`budget`", "`0.5`", "a stale default")])
    stale = f"text\n<!-- settings:begin serve -->\n{table}<!-- settings:end -->\nmore\n"
    fresh = sync(stale, settings_tables())
    assert fresh != stale and "`0.5`" not in fresh and sync(fresh, settings_tables()) == fresh
    assert fresh.startswith("text\n<!-- settings:begin serve -->\n| key |") and fresh.endswith("-->\nmore\n")
    with pytest.raises(KeyError, match="nope"):
        sync("<!-- settings:begin nope -->\n<!-- settings:end -->\n", settings_tables())


def test_a_field_without_a_docstring_is_refused():
    @dataclasses.dataclass
    class Bare:
        documented: int = 1
        """Has one."""
        bare: int = 2

    with pytest.raises(ValueError, match="Bare.bare has no attribute docstring"):
        settings_rows(Bare)


def test_vtoken_settings_prints_the_table_and_checks_the_docs():
    from vtoken.cli import app

    result = CliRunner().invoke(app, ["settings", "--table", "serve"])
    assert result.exit_code == 0, result.output
    assert result.stdout == settings_tables()["serve"]
    assert CliRunner().invoke(app, ["settings", "--check"]).exit_code == 0
    assert CliRunner().invoke(app, ["settings", "--table", "nope"]).exit_code != 0
