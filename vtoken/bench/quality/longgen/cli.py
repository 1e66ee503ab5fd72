"""``vtoken bench longgen``: parse the points, run, emit the report (module doc of ``vtoken.bench.quality.longgen``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from vtoken.bench.report import command_line, emit, refuse
from vtoken.models.default import MODEL_HELP

DEFAULT_POINT = "default"  # the engine's defaults, VTokenConfig() as it is declared


def parse_point(text: str):
    """``"default"`` or ``"key=value,key=value"`` → ``(text, VTokenConfig)`` with those settings over the engine's
    defaults: each item is read as ``--set vtoken.key=value`` is (``vtoken.core.config.with_sets``: a value typed as
    its setting, an unknown key refused with the valid ones listed); ``ConfigError`` naming the point and the
    bad item."""
    from vtoken.core.config import SET_PREFIX, VTokenConfig, with_sets
    from vtoken.errors import ConfigError

    text = text.strip()
    if text == DEFAULT_POINT:
        return text, VTokenConfig()
    items = [item.strip() for item in text.split(",")]
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"point {text!r}: {item!r} is not key=value (or use {DEFAULT_POINT!r})")
        if key.strip() == "block_size":
            raise ConfigError(f"point {text!r}: block_size is the engine's (one per run), not a point's")
    try:
        return text, with_sets(VTokenConfig(), [SET_PREFIX + item for item in items])
    except ConfigError as err:  # the parser speaks of --set vtoken.KEY; a point names its keys bare
        raise ConfigError(f"point {text!r}: {str(err).removeprefix('--set ').replace(SET_PREFIX, '')}") from None


def parse_points(texts: list[str], reserved: str | None = None) -> tuple:
    """Every ``--point`` through ``parse_point``; ``ConfigError`` when a label repeats or is ``reserved`` (the
    run's own reference label). Pure."""
    from vtoken.errors import ConfigError

    points = tuple(parse_point(p) for p in texts)
    labels = [label for label, _ in points]
    if len(set(labels)) != len(labels) or reserved in labels:
        named = f" or named {reserved!r} (the reference)" if reserved is not None else ""
        raise ConfigError(f"--point given twice{named}: {texts}")
    return points


def _under_status(name: str, run):
    """``run(on_phase)`` with a spinner named ``name`` on stderr that shows each phase; returns ``(its result,
    seconds it took)``. Side effects: writes the spinner to stderr."""
    from rich.console import Console

    start = time.perf_counter()
    with Console(stderr=True).status(name, spinner="dots") as status:
        result = run(lambda text: status.update(text))
    return result, time.perf_counter() - start


def longgen_cmd(
    point: list[str] = typer.Option(
        ...,
        "--point",
        help="repeatable: 'default' (the engine's defaults) or "
        "'key=value,…' VTokenConfig settings over the defaults, e.g. "
        "'budget=0.1' or 'scope=all,budget=0.9,policy=snapkv'",
    ),
    model: str = typer.Option("default", help=MODEL_HELP),
    windows: int = typer.Option(100, min=2, help="text windows (paired units of the bootstrap)"),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", min=1),
    continuation_tokens: int = typer.Option(
        224, "--continuation-tokens", min=1, help="tokens forced one decode step at a time after the prompt"
    ),
    seed: int = typer.Option(0, help="draws other windows"),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs", min=1, help="requests decoded together"),
    kv_space_gib: int = typer.Option(6, "--kv-space-gib", min=1, help="KV pool (no request may be preempted)"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Long-generation quality on human-written text: perplexity ratio with a paired bootstrap 95 % interval,
    full-vocabulary KL and top-1 agreement against the full cache, eviction after every token, and the
    parity rule's verdict per point."""
    from vtoken.bench.quality.longgen.report import build_report
    from vtoken.bench.quality.longgen.run import LonggenSetup, run_longgen
    from vtoken.bench.quality.longgen.texts import digests, documents
    from vtoken.bench.quality.longgen.texts import windows as draw
    from vtoken.errors import ConfigError

    try:
        points = parse_points(point)
        from transformers import AutoTokenizer

        from vtoken.models.default import resolve_model

        path = str(resolve_model(model))
        docs = documents()
        wins = draw(AutoTokenizer.from_pretrained(path), prompt_tokens + continuation_tokens, windows, seed, docs)
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    setup = LonggenSetup(
        model=path,
        points=points,
        prompt_tokens=prompt_tokens,
        continuation_tokens=continuation_tokens,
        windows=windows,
        seed=seed,
        max_num_seqs=max_num_seqs,
        kv_space_gib=kv_space_gib,
    )
    measured, seconds = _under_status("longgen", lambda on_phase: run_longgen(setup, wins, on_phase=on_phase))
    emit(build_report(setup, wins, measured, digests(docs), command_line(), seconds), out)


def longgen_figure_cmd(
    reports: list[str] = typer.Argument(..., help="longgen JSON reports of one model and shape"),
    out: str = typer.Option(..., help="the PNG to write"),
) -> None:
    """The yardstick's figure: perplexity ratio (95 % CI) against blocks held, one marker per setting."""
    from vtoken.bench.quality.longgen.plot import plot_longgen

    try:
        loaded = [json.loads(Path(r).read_text()) for r in reports]
        plot_longgen(loaded, out)
    except (OSError, ValueError, KeyError) as err:
        refuse(err)


def codegen_cmd(
    point: list[str] = typer.Option(
        ...,
        "--point",
        help="repeatable, as for longgen: 'default' or 'key=value,…' VTokenConfig settings over the defaults",
    ),
    model: str = typer.Option("default", help=MODEL_HELP),
    problems: int = typer.Option(164, min=2, max=164, help="the first N HumanEval problems (paired units)"),
    max_tokens: int = typer.Option(384, "--max-tokens", min=1, help="longest completion"),
    seed: int = typer.Option(0),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1, help="requests decoded together"),
    kv_space_gib: int = typer.Option(6, "--kv-space-gib", min=1, help="KV pool (no request may be preempted)"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """The parity rule's task half: HumanEval completions (greedy) per point, each problem's unit tests run on
    the point's and on the full cache's completion; paired accuracy difference with its one-sided 95 % lower
    bound and the verdict."""
    from vtoken.bench.quality.longgen.code import problems as load
    from vtoken.bench.quality.longgen.codegen import FULL_LABEL, CodegenSetup, build_report, run_codegen
    from vtoken.errors import ConfigError

    try:
        points = parse_points(point, reserved=FULL_LABEL)
        from vtoken.models.default import resolve_model

        path = str(resolve_model(model))
        load()  # the data is installed: fail here, not after the engine ran
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    setup = CodegenSetup(
        model=path,
        points=points,
        problems=problems,
        max_tokens=max_tokens,
        seed=seed,
        max_num_seqs=max_num_seqs,
        kv_space_gib=kv_space_gib,
    )
    judged, seconds = _under_status("codegen", lambda on_phase: run_codegen(setup, on_phase=on_phase))
    emit(build_report(setup, judged, command_line(), seconds), out)


def trade_figure_cmd(
    longgen: list[str] = typer.Option(..., "--longgen", help="longgen reports of one model and shape"),
    codegen: list[str] = typer.Option([], "--codegen", help="codegen reports of the same model"),
    served: list[str] = typer.Option([], "--served", help="`vtoken bench serve` reports (served gain)"),
    out: str = typer.Option(..., help="the PNG to write"),
) -> None:
    """One model's trade: quality cost (perplexity ratio, HumanEval difference) against the gain over the full
    cache — KV capacity for every point, the measured served gain over stock vLLM where one was run."""
    from vtoken.bench.quality.longgen.plot import plot_trade

    try:

        def load(paths):
            return [json.loads(Path(p).read_text()) for p in paths]

        plot_trade(load(longgen), load(codegen), load(served), out)
    except (OSError, ValueError, KeyError) as err:
        refuse(err)
