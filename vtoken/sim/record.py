"""Record real attention traces from a Hugging Face model for the trace-driven simulator.

For each prompt: generate ``gen_len`` tokens greedily with the full cache (no eviction, EOS suppressed so
every request has T = prompt + gen_len tokens), then run one eager fp32 forward over all T tokens with
``output_attentions=True``. Causal attention with a full cache gives every decode query the same row it
had during generation, so one forward records all T query rows at once::

    attn[i, j]   = mean over layers and heads of softmax(q_i · k_j / √d)   (i ≥ j; 0 above the diagonal)
    key_norm[j]  = mean over layers and KV heads of ‖k_j‖₂  (post-RoPE; RoPE is a rotation, so = pre-RoPE)

File format (one compressed ``.npz``, no pickles): ``attn_<i>`` [T_i, T_i], ``knorm_<i>`` [T_i],
``prompt_len_<i>`` (0-d int) for i = 0 .. n-1, and ``meta`` (0-d str, JSON: model, date, source, gen_len,
dtype, count, aggregation). ``attn`` may be stored as float16 (values < 6e-5 lose relative precision;
rows then sum to 1 within ~1e-3); ``load_traces`` always returns float32.

Embedded prompts (``vtoken/sim/texts/*.txt``) are public-domain English prose, excerpts of:
Austen, *Pride and Prejudice* (1813) ch. 1; Carroll, *Alice's Adventures in Wonderland* (1865) ch. 1;
Dickens, *A Tale of Two Cities* (1859) I.1; Doyle, "A Scandal in Bohemia" (1891); Melville, *Moby-Dick*
(1851) ch. 1; Shelley, *Frankenstein* (1818) letter 1. 590-700 SmolLM2 tokens each.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

AGGREGATION = "mean over layers and heads of post-softmax attention; key norm: mean over layers and KV heads"


@dataclass(frozen=True)
class AttentionTrace:
    """One request's full-cache attention: ``attn`` float32 [T, T] lower-triangular (row = query),
    ``key_norm`` float32 [T], and the number of prompt tokens (rows ``prompt_len-1 ..`` produced outputs)."""

    attn: np.ndarray
    key_norm: np.ndarray
    prompt_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.attn.shape[0])


def embedded_texts() -> dict[str, str]:
    """The packaged prose passages, ``{file name: text}`` in name order. Reads package data only."""
    folder = resources.files("vtoken.sim").joinpath("texts")
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    return {name: folder.joinpath(name).read_text(encoding="utf-8") for name in names}


def record_trace(model, prompt_ids: list[int], gen_len: int) -> AttentionTrace:
    """Greedy-generate ``gen_len`` tokens after ``prompt_ids`` with ``model`` (eager attention), then
    record attention and key norms over all prompt + generated tokens. Pure (no files, model unchanged)."""
    import torch

    if getattr(model.config, "_attn_implementation", None) != "eager":
        raise ValueError("recording attention needs a model loaded with attn_implementation='eager'")
    if gen_len < 1 or len(prompt_ids) < 1:
        raise ValueError(f"need a non-empty prompt and gen_len >= 1, got {len(prompt_ids)} / {gen_len}")
    with torch.inference_mode():
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long)
        ids = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        out = model(input_ids=ids, output_attentions=True, use_cache=True)
        attn = torch.stack([a[0].float().mean(dim=0) for a in out.attentions]).mean(dim=0)
        layers = out.past_key_values.layers
        knorm = torch.stack([layer.keys[0].float().norm(dim=-1).mean(dim=0) for layer in layers])
    return AttentionTrace(
        attn.numpy().astype(np.float32), knorm.mean(dim=0).numpy().astype(np.float32), len(prompt_ids)
    )


def record_traces(
    model_path: str | Path,
    prompts: list[str],
    gen_len: int,
    out: Path,
    prompt_len: int | None = None,
    dtype: str = "float16",
    source: str = "",
    model_name: str | None = None,
) -> Path:
    """Record one trace per prompt and save them to ``out`` (format in the module doc); returns ``out``.

    ``prompt_len`` truncates every tokenized prompt to that many tokens (a shorter prompt raises
    ``ValueError`` naming it); None keeps full prompts. ``dtype`` ("float16" | "float32") is the storage
    type of ``attn``; ``model_name`` goes to the metadata (default: the path). Side effects: loads the
    model, writes ``out`` atomically (temp file + rename).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    if not prompts:
        raise ValueError("no prompts to record")
    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    arrays: dict[str, np.ndarray] = {}
    for i, text in enumerate(prompts):
        ids = tok(text)["input_ids"]
        if prompt_len is not None:
            if len(ids) < prompt_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, fewer than prompt_len={prompt_len}")
            ids = ids[:prompt_len]
        trace = record_trace(model, ids, gen_len)
        arrays[f"attn_{i}"] = trace.attn.astype(dtype)
        arrays[f"knorm_{i}"] = trace.key_norm
        arrays[f"prompt_len_{i}"] = np.asarray(trace.prompt_len, dtype=np.int64)
    meta = {
        "model": model_name or str(model_path),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "source": source,
        "gen_len": gen_len,
        "dtype": dtype,
        "count": len(prompts),
        "aggregation": AGGREGATION,
    }
    arrays["meta"] = np.asarray(json.dumps(meta))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".npz", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_traces(path: str | Path) -> list[AttentionTrace]:
    """Read every trace in a file written by ``record_traces`` (float32 arrays, in index order)."""
    with np.load(Path(path), allow_pickle=False) as data:
        count = sum(1 for k in data.files if k.startswith("attn_"))
        return [
            AttentionTrace(
                attn=data[f"attn_{i}"].astype(np.float32),
                key_norm=data[f"knorm_{i}"].astype(np.float32),
                prompt_len=int(data[f"prompt_len_{i}"]),
            )
            for i in range(count)
        ]


def load_metadata(path: str | Path) -> dict:
    """The ``meta`` record of a trace file (model, date, source, gen_len, dtype, count, aggregation)."""
    with np.load(Path(path), allow_pickle=False) as data:
        return json.loads(str(data["meta"]))
