"""The two tasks of ``vtoken bench quality``, without an engine: instances and scoring (pure functions).

* **Retrieval (pass key)**: a 5-digit key hidden at a given depth of repetitive filler, asked for at the
  end, in the model's chat template (a base model without one: plain text ending "Answer: The pass key
  is"). Correct when the generated text contains the key. The context length
  is calibrated so the full cache solves it (SmolLM2-135M-Instruct: 10/10 at ≈ 470 prompt tokens, 6/10 at
  ≈ 850); the report carries the full-cache accuracy next to every point.
* **Language modelling**: windows of real prose; the prompt's own log-probabilities give the perplexity.
  The prose is the package's embedded passages (``vtoken/sim/texts``: public-domain excerpts that a
  pretrained model may have seen) plus passages written for this benchmark (``vtoken/bench/texts``,
  held out from any pretraining corpus); the report names the windows it used.

``--seed`` draws other instances: other keys and filler offsets, other window offsets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INSTRUCTION = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it."
QUESTION = "What is the pass key?"


@dataclass(frozen=True)
class PasskeyCase:
    """One retrieval instance: ``prompt_ids`` ask for ``key``, hidden at ``depth`` (0 = start, 1 = end)."""

    name: str
    depth: float
    key: str
    prompt_ids: tuple[int, ...]

    def correct(self, generated_text: str) -> bool:
        return self.key in generated_text


@dataclass(frozen=True)
class TextWindow:
    """One language-modelling instance: ``prompt_ids`` are ``source``'s tokens from ``offset``."""

    name: str
    source: str
    offset: int
    prompt_ids: tuple[int, ...]


def passkey_cases(
    tokenizer, context_tokens: int, depths: tuple[float, ...], per_depth: int, seed: int
) -> list[PasskeyCase]:
    """``per_depth`` instances at each depth (± one filler sentence group, drawn from the seed), about
    ``context_tokens`` of filler each (pure given the seed)."""
    rng = random.Random(seed)
    filler_len = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    reps = max(2, context_tokens // filler_len)
    cases = []
    for depth in depths:
        for i in range(per_depth):
            key = str(rng.randint(10_000, 99_999))
            needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
            before = min(reps, max(0, round(reps * depth) + rng.randint(-1, 1)))  # the seed moves it too
            text = FILLER * before + needle + FILLER * (reps - before)
            ids = _ask(tokenizer, f"{INSTRUCTION}\n\n{text}\n\n{QUESTION}")
            cases.append(PasskeyCase(f"passkey-d{depth:g}-{i}", depth, key, tuple(int(t) for t in ids)))
    return cases


def _ask(tokenizer, content: str) -> list[int]:
    """The prompt ids of a question: in the model's chat template, or for a base model without one (Gemma 3
    270M) as plain text that starts the answer, with the tokenizer's own special tokens (its ``<bos>``)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(f"{content}\nAnswer: The pass key is")["input_ids"])
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def bos_ids(tokenizer) -> list[int]:
    """``[<bos>]`` when the model's tokenizer starts every prompt with it (Gemma 3: its output is incoherent
    without), else ``[]`` (SmolLM2). Windows of prose start with it in place of their first token."""
    bos = getattr(tokenizer, "bos_token_id", None)
    first = tokenizer("a")["input_ids"][:1]
    return [bos] if bos is not None and first == [bos] else []


def prose_sources() -> dict[str, str]:
    """``{name: text}``: the held-out passages first, then the embedded ones, each group by name (reads
    package data only). Callers take windows in this order."""
    out = {}
    for package, folder in (("vtoken.bench", "texts"), ("vtoken.sim", "texts")):
        root = resources.files(package).joinpath(folder)
        for name in sorted(p.name for p in root.iterdir() if p.name.endswith(".txt")):
            out[f"{package.split('.')[-1]}/{name}"] = root.joinpath(name).read_text(encoding="utf-8")
    return out


def text_windows(tokenizer, tokens: int, count: int, seed: int) -> list[TextWindow]:
    """``count`` windows of ``tokens`` tokens, one per source (held-out sources first), at seeded offsets.

    Raises ``ValueError`` if a source is shorter than ``tokens`` or there are fewer than ``count`` sources.
    """
    rng = random.Random(seed)
    sources = prose_sources()
    order = list(sources)
    if count > len(order):
        raise ValueError(f"{count} text windows asked for, {len(order)} prose sources available")
    windows, bos = [], bos_ids(tokenizer)  # Gemma 3: <bos> first, in place of the window's first token
    for name in order[:count]:
        ids = tokenizer(sources[name], add_special_tokens=False)["input_ids"]
        if len(ids) < tokens:
            raise ValueError(f"prose source {name} has {len(ids)} tokens, fewer than the window ({tokens})")
        offset = rng.randint(0, len(ids) - tokens)
        windows.append(TextWindow(f"lm-{name}", name, offset, tuple(bos + ids[offset : offset + tokens - len(bos)])))
    return windows


def perplexity(token_logprobs: list[float]) -> float:
    """exp(−mean log-probability) of the scored tokens (the first token of a window has none)."""
    if not token_logprobs:
        return float("nan")
    return math.exp(-sum(token_logprobs) / len(token_logprobs))
