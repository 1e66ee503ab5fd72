"""The settings table, derived: one row per field of a settings dataclass — its name, its default and its
meaning, the attribute docstring written right under the field (vLLM's ``config/cache.py`` style).

``attribute_docs`` reads those strings from the class's source; ``settings_table`` renders the Markdown table;
``sync`` rewrites the table between ``<!-- settings:begin NAME -->`` and ``<!-- settings:end -->`` in a
document, so docs include the table instead of copying defaults (``vtoken settings --write``, ``make docs``;
a test holds the committed docs to the renderer's output). Pure, numpy-free; no vtoken import.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from collections.abc import Iterable, Mapping
from enum import Enum
from functools import cache
from typing import Any

__all__ = ["attribute_docs", "shown_default", "settings_rows", "settings_table", "sync"]

_REGION = re.compile(r"(<!-- settings:begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- settings:end -->)", re.S)


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for every annotated field of ``cls`` followed by a string literal (cleaned with
    ``inspect.cleandoc``), in declaration order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    first = tree.body[0]
    if not isinstance(first, ast.ClassDef):
        raise TypeError(f"{cls!r}: its source is not a class definition")
    body = first.body
    out = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def shown_default(value: Any) -> str:
    """A default as a config file spells it: ``null``, ``true``/``false``, an enum's value, a budget's number
    (anything with ``to_json``), else ``str``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if hasattr(value, "to_json"):
        return str(value.to_json())
    return str(value)


def settings_rows(
    cls: type, prefix: str = "", skip: Iterable[str] = (), shown: Mapping[str, str] | None = None
) -> list[tuple[str, str, str]]:
    """``(name, default, meaning)`` per field of the dataclass ``cls`` but ``skip``, in declaration order:
    ``prefix`` + name, the default in backticks (``shown`` replaces it by field name, e.g. where another layer
    supplies it) and the docstring on one line. ``ValueError`` names a field without a docstring or a
    default."""
    docs, skip, shown = attribute_docs(cls), set(skip), dict(shown or {})
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name not in docs:
            raise ValueError(f"{cls.__name__}.{f.name} has no attribute docstring")
        if f.name in shown:
            default = shown[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f"`{shown_default(f.default)}`"
        else:
            raise ValueError(f"{cls.__name__}.{f.name} has no default to show")
        rows.append((f"`{prefix}{f.name}`", default, " ".join(docs[f.name].split()).replace("|", "\\|")))
    return rows


def settings_table(rows: Iterable[tuple[str, str, str]]) -> str:
    """The Markdown table ``| key | default | meaning |`` of ``rows`` (ends with a newline)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| {name} | {default} | {meaning} |" for name, default, meaning in rows]
    return "\n".join(lines) + "\n"


def sync(text: str, tables: Mapping[str, str]) -> str:
    """``text`` with every marked region replaced by its table (``tables[NAME]``); ``KeyError`` names a region
    without a table. A region is the lines between ``<!-- settings:begin NAME -->`` and ``<!-- settings:end -->``."""

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in tables:
            raise KeyError(f"no settings table named {name!r}; known: {', '.join(tables)}")
        return m.group(1) + tables[name] + m.group(4)

    return _REGION.sub(fill, text)
