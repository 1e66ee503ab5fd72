"""Tiny random-weight Hugging Face checkpoints for fast tests (no hub, built locally in < 2 s).

``tiny_model("llama")`` / ``tiny_model("qwen2")`` return a directory holding ``config.json``,
``model.safetensors`` (fp32), ``generation_config.json`` and a byte-level BPE tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat template). Both load in vLLM CPU
(``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, ``dtype="float32"``) and in transformers
(``attn_implementation="eager"``).

::

    arch    layers hidden heads kv_heads head_dim  GQA  qkv bias  rope_theta  vocab  max_pos
    llama        2    128     4        2       32    2        no      10 000    512     8192
    qwen2        3    192     6        1       32    6       yes   1 000 000    512     8192
    gemma3       4    128     4        1       32    4        no  1 000 000 *  512     8192

``gemma3`` (``Gemma3ForCausalLM``, text only) is a hybrid model: layers 0-2 attend a sliding window of 64
tokens (RoPE theta 10 000), layer 3 is global (*: theta 1 000 000); untied embeddings (tied, the residual
stream of random weights keeps repeating the last token). vLLM builds 4 KV cache groups of one layer
each: 3 ``SlidingWindowSpec``, 1 ``FullAttentionSpec``.

Weights are drawn from a ``torch.Generator`` seeded with ``seed`` (independent of transformers' own
init), scaled so that activations stay O(1): attention is clearly non-uniform and the top-1/top-2 logit
gap is large enough for HF and vLLM greedy runs to agree. The ``lm_head`` rows of the special tokens
are zero, so greedy decoding never emits ``<|im_end|>`` and always runs to ``max_tokens``.

Building is deterministic (same seed → byte-identical safetensors), idempotent (an existing directory is
returned as is) and safe under concurrency: each builder writes a private temp directory next to the
target and renames it into place; the loser of a race deletes its copy and uses the winner's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

# Bump when the recipe (shapes, init, tokenizer) changes: old cache entries are then simply unused.
RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Tokenizer training text (public domain: Jane Austen, "Pride and Prejudice", 1813, chapter 1).
_CORPUS = """It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on his first
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he
is considered the rightful property of some one or other of their daughters. "My dear Mr. Bennet," said
his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied that
he had not. "But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."
Mr. Bennet made no answer. "Do you not want to know who has taken it?" cried his wife impatiently. "You
want to tell me, and I have no objection to hearing it." This was invitation enough. "Why, my dear, you
must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from the north of
England; that he came down on Monday in a chaise and four to see the place, and was so much delighted
with it, that he agreed with Mr. Morris immediately; that he is to take possession before Michaelmas,
and some of his servants are to be in the house by the end of next week." What is the capital of
France? The capital of France is Paris. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 + - * / = ( ) [ ] { } < >
"""


@dataclass(frozen=True)
class TinySpec:
    """Shape of one tiny architecture. ``name`` is the ``arch`` argument of ``tiny_model``."""

    name: str
    model_type: str  # transformers config class key: "llama" | "qwen2"
    architecture: str  # vLLM / transformers class name
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    qkv_bias: bool
    vocab_target: int = 512
    max_positions: int = 8192
    extra: tuple[tuple[str, object], ...] = ()  # further config fields (hybrid layer kinds, windows)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY_SPECS: Mapping[str, TinySpec] = MappingProxyType(
    {  # read-only
        "llama": TinySpec("llama", "llama", "LlamaForCausalLM", 2, 128, 4, 2, 256, 10_000.0, False),
        "qwen2": TinySpec("qwen2", "qwen2", "Qwen2ForCausalLM", 3, 192, 6, 1, 384, 1_000_000.0, True),
        "gemma3": TinySpec(
            "gemma3",
            "gemma3_text",
            "Gemma3ForCausalLM",
            4,
            128,
            4,
            1,
            256,
            1_000_000.0,
            False,
            extra=(
                ("sliding_window", 64),
                ("query_pre_attn_scalar", 32),
                ("layer_types", ["sliding_attention"] * 3 + ["full_attention"]),
                (
                    "rope_parameters",
                    {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                    },
                ),
            ),
        ),
    }
)


def default_cache_dir() -> Path:
    """``$VTOKEN_CACHE_DIR`` if set, else ``~/.cache/vtoken``. Pure (creates nothing)."""
    env = os.environ.get("VTOKEN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vtoken"


def tiny_spec(arch: str) -> TinySpec:
    """The spec of ``arch``; unknown names raise ``ValueError`` listing the valid ones."""
    try:
        return TINY_SPECS[arch]
    except KeyError:
        raise ValueError(f"unknown tiny architecture {arch!r}; valid: {', '.join(TINY_SPECS)}") from None


def tiny_model(arch: str = "llama", cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Path of the tiny ``arch`` checkpoint under ``<cache_dir>/models``; builds it on first use.

    Side effects: creates ``<cache_dir>/models/tiny-<arch>-s<seed>-r<RECIPE_VERSION>`` if missing
    (atomic rename from a temp dir in the same folder). Never modifies an existing checkpoint.
    """
    spec = tiny_spec(arch)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"tiny-{spec.name}-s{seed}-r{RECIPE_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(spec, seed, tmp)
        publish_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def publish_dir(tmp: Path, target: Path) -> None:
    """Atomically rename the finished ``tmp`` to ``target``. If another process published ``target``
    first, keep theirs (``tmp`` is left for the caller to delete)."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def build_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer`` (≤ 512 tokens) trained on the embedded corpus.

    Deterministic; special tokens get ids 0, 1, 2 (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_SPECS["llama"].vocab_target,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def _build(spec: TinySpec, seed: int, out: Path) -> None:
    """Write config, weights, generation config and tokenizer of ``spec`` into ``out`` (mutates ``out``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_positions
    vocab = len(fast)
    special_ids = [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    fields = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        dtype="float32",
        architectures=[spec.architecture],
    )
    config = AutoConfig.for_model(spec.model_type, **{**fields, **dict(spec.extra)})
    if spec.model_type in ("llama", "gemma3_text"):
        config.head_dim = spec.head_dim
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, special_ids)
    model.generation_config = GenerationConfig(
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


def _init_weights(model, seed: int, special_ids: list[int]) -> None:
    """Overwrite every parameter from a generator seeded with ``seed`` (mutates ``model``).

    Matrices ~ N(0, 1/fan_in) (embeddings ~ N(0, 1)), norms = 1, biases ~ N(0, 0.1²) (Gemma: norms 0 and
    embeddings ~ N(0, 1/hidden), the same scales after its 1 + w and sqrt(hidden) factors); the ``lm_head``
    rows of ``special_ids`` are zeroed. Parameters are visited in sorted-name order.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")  # norms scale by 1 + w; embeddings by sqrt(hidden)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(0.0 if gemma else 1.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[1] ** 0.5 if gemma else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        model.lm_head.weight[special_ids] = 0.0
