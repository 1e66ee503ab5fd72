"""RULER-style synthetic tasks for ``vtoken bench quality``, generated offline from the model's tokenizer.

The definitions match the tasks lm-eval ships as ``ruler`` (templates, needle sentence, key and value
kinds, haystacks, the prompt + answer-prefix format its ``local-completions`` sends, the length budget
``prompt + tokens_to_generate ≤ length``, and ``string_match_all`` scoring), so a number here compares
with ``lm_eval --tasks niah_single_1 …`` against ``vtoken serve`` (docs/quality.md has the recipe).
Differences, stated: instances are drawn from our own seeded generator (not lm-eval's samples); the
essay haystack (``niah_multivalue``/``niah_multiquery`` in lm-eval, downloaded) is replaced by the
repeated-sentence haystack, which needs no download; ``vt`` carries one in-context example like lm-eval's.

The prompt templates are RULER's (NVIDIA, Apache-2.0, as lm-eval ships them), kept word for word so
prompts compare. Words are wonderwords' lists (MIT; the package lm-eval's generators draw from). Pure functions of
(tokenizer, task, length, samples, seed); nothing here starts an engine.
"""

from __future__ import annotations

import random
import string
import uuid
import zlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assgined the value {query}, they are:"
)  # lm-eval's spelling, kept so prompts are identical
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


@dataclass(frozen=True)
class RulerTask:
    """One task's definition. ``budget_tokens`` is lm-eval's ``tokens_to_generate`` (it sizes the
    haystack); ``answer_tokens`` is what we generate (enough for every answer, fewer than lm-eval's
    128 so a point costs less; the answer is complete long before)."""

    name: str
    kind: str  # niah | vt | cwe
    haystack: str = "repeat"  # niah: repeat | needle (distractor needles with other keys)
    key_kind: str = "words"
    value_kind: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    budget_tokens: int = 128
    answer_tokens: int = 32
    step: int = 5  # haystack units added per sizing step (lm-eval's ``incremental`` below 4k tokens)


TASKS = {
    t.name: t
    for t in (
        RulerTask("niah_single_1", "niah"),
        RulerTask("niah_multikey_2", "niah", haystack="needle"),
        RulerTask("niah_multikey_3", "niah", haystack="needle", key_kind="uuids", value_kind="uuids", answer_tokens=48),
        RulerTask("niah_multivalue", "niah", num_v=4, answer_tokens=64),
        RulerTask("niah_multiquery", "niah", num_k=4, num_q=4, answer_tokens=64),
        RulerTask("vt", "vt", budget_tokens=30, answer_tokens=30),
        RulerTask("cwe", "cwe", budget_tokens=120, answer_tokens=80, step=10),
    )
}


@dataclass(frozen=True)
class RulerCase:
    """One instance: ``prompt_ids`` (template + answer prefix, as lm-eval sends it) ask for ``answers``."""

    name: str
    task: str
    length: int  # the task's length budget (prompt + lm-eval's tokens_to_generate ≤ length)
    answers: tuple[str, ...]
    prompt_ids: tuple[int, ...]
    max_tokens: int

    def score(self, generated_text: str) -> float:
        """lm-eval's ``string_match_all``: the fraction of answers found in the text (case-insensitive)."""
        text = generated_text.strip().lower()
        return sum(a.lower() in text for a in self.answers) / len(self.answers)

    def solved(self, generated_text: str) -> bool:
        return self.score(generated_text) == 1.0


@lru_cache(maxsize=1)
def _words() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns, single words for cwe) from wonderwords' lists, sorted (reads package data)."""
    root = resources.files("wonderwords").joinpath("assets")

    def read(name: str) -> list[str]:
        return [w.strip() for w in root.joinpath(name).read_text(encoding="utf-8").splitlines() if w.strip()]

    nouns, adjs, verbs = read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")
    return tuple(sorted(set(adjs))), tuple(sorted(set(nouns))), tuple(sorted(set(nouns + adjs + verbs)))


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":  # an adjective-noun key, as lm-eval's (drawn per part, not from the 6 M pairs)
        adjs, nouns, _ = _words()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle kind {kind!r}: numbers | words | uuids")


def _niah(task: RulerTask, units: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    keys, values, needles = [], [], []
    for _ in range(task.num_k):
        keys.append(_draw(rng, task.key_kind))
        values.append([_draw(rng, task.value_kind) for _ in range(task.num_v)])
        needles += [NEEDLE.format(kind=task.value_kind, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if task.haystack == "needle":
        lines = [
            NEEDLE.format(kind=task.value_kind, key=_draw(rng, task.key_kind), value=_draw(rng, task.value_kind))
            for _ in range(units)
        ]
    else:
        lines = [REPEAT] * units
    for index, needle in zip(sorted(rng.sample(range(units), len(needles)), reverse=True), needles):
        lines.insert(index, needle)
    asked = rng.sample(range(task.num_k), task.num_q)
    queries = [keys[i] for i in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = NIAH_TEMPLATE, task.value_kind
    single = task.num_q * task.num_v == 1
    if single:  # lm-eval's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        kind = kind[:-1]
    text = template.format(kind=kind, context="\n".join(lines), query=query)
    prefix = f"The special magic {kind} for {query} mentioned in the provided text " + ("is" if single else "are")
    return text + " " + prefix, tuple(v for i in asked for v in values[i])


def _vt_instance(units: int, rng: random.Random, hops: int = 4) -> tuple[str, str, tuple[str, ...]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [REPEAT + "\n"] * units
    for offset, (pos, line) in enumerate(zip(sorted(rng.sample(range(units), len(chain))), chain)):
        lines.insert(pos + offset, line)
    context = " ".join(lines).replace(". \n", ".\n")
    return VT_TEMPLATE.format(context=context, query=value), value, tuple(names)


def _vt(task: RulerTask, units: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    ex_text, ex_value, ex_names = _vt_instance(5, rng)  # the in-context example, answered
    example = f"{ex_text} {VT_PREFIX.format(n=len(ex_names), query=ex_value)} {' '.join(ex_names)}\n\n"
    text, value, names = _vt_instance(units, rng)
    return example + text + " " + VT_PREFIX.format(n=len(names), query=value), names


def _cwe(task: RulerTask, units: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    words = _words()[2]

    def listing(count: int, common_repeats: int) -> tuple[str, list[str]]:
        chosen = rng.sample(words, count)
        common = chosen[:10]
        items = common * common_repeats + chosen[10:]
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common

    ex_context, ex_common = listing(20, 3)  # lm-eval below 4k tokens: example 3×, task 6×, others once
    example = (
        CWE_TEMPLATE.format(context=ex_context)
        + " "
        + CWE_PREFIX
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
    )
    context, common = listing(max(units, 11), 6)
    return example + "\n" + CWE_TEMPLATE.format(context=context) + " " + CWE_PREFIX, tuple(common)


_BUILD = {"niah": _niah, "vt": _vt, "cwe": _cwe}


def ruler_cases(tokenizer, task: str, length: int, samples: int, seed: int) -> list[RulerCase]:
    """``samples`` instances of ``task`` whose prompt + the task's ``budget_tokens`` fit ``length`` tokens,
    the haystack as large as fits (sized like lm-eval: in steps of ``step`` units). Pure given the seed.

    Raises ``ValueError`` naming the task if it is unknown or nothing fits ``length``.
    """
    if task not in TASKS:
        raise ValueError(f"task {task!r}: one of {', '.join(TASKS)}")
    spec = TASKS[task]
    build = _BUILD[spec.kind]
    rng = random.Random(seed * 1_000_003 + zlib.crc32(f"{task}@{length}".encode()))

    def fits(units: int) -> tuple[list[int], tuple[str, ...]] | None:
        """An instance of ``units`` haystack units as (token ids, answers), or None if it is too long."""
        text, answers = build(spec, units, rng)
        ids = tokenizer(text)["input_ids"]
        return (ids, answers) if len(ids) + spec.budget_tokens <= length else None

    minimum = {"niah": spec.num_k * spec.num_v, "vt": 6, "cwe": 11}[spec.kind]  # room for every needle / chain
    if fits(minimum) is None:
        raise ValueError(f"task {task}: no instance fits {length} tokens (raise the length)")
    units = minimum
    while fits(units + spec.step) is not None:
        units += spec.step
    cases = []
    for i in range(samples):
        made, size = None, units
        while made is None and size >= minimum:
            made, size = fits(size), size - spec.step
        if made is None:
            raise ValueError(f"task {task}: sample {i} does not fit {length} tokens")
        ids, answers = made
        cases.append(
            RulerCase(f"{task}@{length}-{i}", task, length, answers, tuple(int(t) for t in ids), spec.answer_tokens)
        )
    return cases
