"""The settings tables state the engine's defaults: docs/vllm-integration.md ("Settings"), docs/serving.md
("Configuration") and ``vtoken/vllm/config.py``'s docstring each list ``VTokenConfig``'s defaults by hand;
every default they give must be the dataclass's. Pure file reading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vtoken.core.config import VTokenConfig

ROOT = Path(__file__).resolve().parents[2]
TICKED = re.compile(r"`([^`]*)`")
UNSET = {"null", "None", "unset"}


def shown(value) -> set[str]:
    """The spellings a table may use for ``value`` (a ``VTokenConfig.to_dict`` value)."""
    return UNSET if value is None else {str(value), f"'{value}'"}


def stale(stated: dict[str, str]) -> dict[str, tuple[str, object]]:
    """``{setting: (stated, VTokenConfig's default)}`` for every stated default that is not the dataclass's
    (``block_size``'s is vLLM's, not ours: skipped)."""
    defaults = VTokenConfig().to_dict()
    return {k: (v, defaults[k]) for k, v in stated.items() if k != "block_size" and v not in shown(defaults[k])}


def markdown_defaults(text: str, prefix: str = "", column: int = -1) -> dict[str, str]:
    """``{setting: default as written}`` from the rows of markdown tables whose first cell names settings
    (``prefix``: the key's prefix, e.g. ``vtoken.``) and whose ``column`` gives their defaults, both split on
    `` / `` in the same order; only ``VTokenConfig`` keys."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2:
            continue
        keys = [k.removeprefix(prefix) for k in TICKED.findall(cells[0])]
        values = TICKED.findall(cells[column])
        if not keys or not all(k in VTokenConfig.keys() for k in keys):
            continue
        if cells[0].count("/") + 1 != len(keys) or len(values) < len(keys):
            continue
        out.update(zip(keys, values[: len(keys)]))
    return out


def docstring_defaults(text: str) -> dict[str, str]:
    """``{setting: default}`` from ``vtoken/vllm/config.py``'s table: a line ``    key   …   default``
    (the default is the last word; a wrapped description puts it on the continuation line)."""
    out, key = {}, None
    for line in text.split('"""')[1].splitlines():
        m = re.match(r"^    (\w+)\s", line)
        if m and m.group(1) in VTokenConfig.keys():
            key = m.group(1)
        elif not line.startswith("     "):
            key = None
        if key is not None and line.split():
            out[key] = line.split()[-1]
    return out


@pytest.mark.parametrize("doc, prefix, column",
                         [("docs/vllm-integration.md", "", -1), ("docs/serving.md", "vtoken.", 1)])
def test_the_markdown_settings_tables_state_the_engines_defaults(doc, prefix, column):
    stated = markdown_defaults((ROOT / doc).read_text(), prefix, column)
    assert {"policy", "budget", "scope", "keep_mass"} <= set(stated), stated  # the table was found
    assert not stale(stated), f"{doc}: stated default ≠ VTokenConfig's: {stale(stated)}"


def test_the_engine_settings_docstring_states_the_engines_defaults():
    stated = docstring_defaults((ROOT / "vtoken" / "vllm" / "config.py").read_text())
    assert {"policy", "budget", "scope", "mode"} <= set(stated), stated
    assert not stale(stated), f"vtoken/vllm/config.py: stated default ≠ VTokenConfig's: {stale(stated)}"


def test_a_table_with_a_stale_default_is_caught():
    table = "| key | values | default |\n|---|---|---|\n| `budget` | fraction | `0.5` |\n| `scope` | x | `all` |\n"
    assert set(stale(markdown_defaults(table))) == {"budget", "scope"}
