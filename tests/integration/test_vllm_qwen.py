"""Qwen2.5-Coder-0.5B-Instruct (issue 38: a model that can use its context) in the real vLLM engine.

One shared engine (fp32, block size 32, in-process) runs every test: vLLM's own path (``mode: none``) gives
the HF fp32 model's greedy tokens and a right answer, and every registered policy in repack gives the masked
HF reference's greedy tokens on two prompts (prose, and a chat-template code question) with prompt tokens
evicted. The model is converted once from its six GGUF part packages (the ``qwen`` extra, ~45 s).
"""

from __future__ import annotations

import json

import pytest
from support.engine import TOL, shutdown, sp

from vtoken.vllm.offline.launch import start_engine
from vtoken.vllm.offline.verify import VerifyCase, make_prompt, run_cases

pytestmark = pytest.mark.slow

CODE_QUESTION = (
    "Here is a function:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs)\n\nWhat does it return for an empty list, and how would you fix "
    "it so that it returns None instead? Answer with the corrected code and one sentence."
)


@pytest.fixture(scope="module")
def qwen():
    """(checkpoint directory, the HF fp32 eager reference model)."""
    from vtoken.models.default import resolve_model
    from vtoken.models.hf_reference import load_reference_model

    path = resolve_model("qwen2.5-coder-0.5b")
    return path, load_reference_model(path)


@pytest.fixture(scope="module")
def qwen_engine(qwen, tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    llm = start_engine(str(qwen[0]), 32, str(d), max_model_len=512)
    yield llm, d
    shutdown(llm)


def _chat(path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_the_conversion_keeps_the_gguf_header(qwen):
    """The checkpoint is the GGUF's Qwen2 (24 layers, 14 q / 2 KV heads of 64, RoPE base 1e6, untied head),
    plain fp32 with no quantization config, and its tokenizer carries the chat template and ``<|im_end|>``."""
    path, _ = qwen
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_hidden_layers"] == 24
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (896, 14, 2)
    assert cfg["rope_parameters"]["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 32768
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32" and not cfg["use_sliding_window"]
    tok = json.loads((path / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>" and (path / "chat_template.jinja").is_file()


def test_vllm_greedy_equals_hf_fp32_and_answers(qwen, qwen_engine):
    """vLLM's own path (``mode: none``) gives the HF fp32 model's greedy tokens, and they say Paris."""
    import torch
    from transformers import AutoTokenizer

    path, ref = qwen
    llm, _ = qwen_engine
    ids = _chat(path, "What is the capital of France? Answer in one sentence.")
    out = llm.generate([{"prompt_token_ids": ids}], [sp(8, mode="none")], use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    assert len(hf) >= 6 and tokens[: len(hf)] == hf  # HF stops at <|im_end|>, vLLM here ignores it
    assert "Paris" in AutoTokenizer.from_pretrained(str(path)).decode(tokens)


@pytest.mark.parametrize("which", ["prose", "code-chat"])
def test_every_policy_is_exact_in_repack(which, qwen, qwen_engine):
    """Every registered policy at 30 % with prompt tokens evicted (scope all), the seven in one batch: the
    masked HF reference's greedy tokens and log-probs (|Δ| ≤ 1e-4; measured ≤ 1.7e-5), on a 160-token prose
    prompt and a chat-template code question."""
    from vtoken.policies import policy_names

    path, ref = qwen
    llm, d = qwen_engine
    prompt = make_prompt(path, 160) if which == "prose" else _chat(path, CODE_QUESTION)
    cases = [VerifyCase(p, "repack", 0.3, name=f"{which}-{p}") for p in policy_names()]
    results = run_cases(path, 32, cases, prompt=prompt, llm=llm, trace_dir=str(d), max_tokens=8, reference_model=ref)
    assert len(results) == len(policy_names()) >= 7
    for r in results:
        assert r.match and r.max_abs_logprob_diff <= TOL, (r.case.key(), r.max_abs_logprob_diff)
        assert r.evicted_tokens > 0, r.case.key()
