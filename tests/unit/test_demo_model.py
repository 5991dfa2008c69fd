"""The offline demo model: loads with transformers, has each arch's switches, is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.cli import main
from radixserve.common.demo_model import ARCHS, make_demo_model

ROUNDTRIP = [
    "hello world",
    "héllo 世界",
    "def f(x):\n    return x ** 2  # squared\n",
    "  two leading spaces, a tab\tand digits 1234567890",
    "emoji 🙂 and Привет, мир!",
]
CHATML_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    arch = request.param
    path = make_demo_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, size="tiny")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return arch, path, model, tok


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_folder_loads_with_the_arch_switches(built):
    arch, path, model, tok = built
    names = _tensor_names(path)
    raw = json.loads((path / "config.json").read_text())
    cfg = model.config
    assert cfg.model_type == arch
    assert raw["dtype"] == "float32"
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.vocab_size == len(tok) >= 1024
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert raw["head_dim"] == 16
    if arch == "llama":
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "llama3"
        assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
        assert rope["original_max_position_embeddings"] < cfg.max_position_embeddings
        assert cfg.tie_word_embeddings is False
        assert "lm_head.weight" in names
        assert not any(n.endswith("q_proj.bias") for n in names)
    else:
        assert cfg.tie_word_embeddings is True
        assert "lm_head.weight" not in names
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if arch == "qwen2":
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"} <= names
        assert not any("q_norm" in n for n in names)
    if arch == "qwen3":
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names
        assert not any(n.endswith("q_proj.bias") for n in names)


def test_special_token_ids_agree(built):
    _, path, model, tok = built
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id is not None and tok.bos_token_id is not None
    assert len({tok.eos_token_id, endoftext, tok.pad_token_id, tok.bos_token_id}) == 4
    gen = json.loads((path / "generation_config.json").read_text())
    for ids in (model.config, gen):
        get = ids.get if isinstance(ids, dict) else lambda k, c=ids: getattr(c, k)
        assert get("eos_token_id") == [tok.eos_token_id, endoftext]
        assert get("bos_token_id") == tok.bos_token_id
        assert get("pad_token_id") == tok.pad_token_id


@pytest.mark.parametrize("text", ROUNDTRIP)
def test_tokenizer_round_trips(built, text):
    _, _, _, tok = built
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_all_archs_tokenize_alike(built):
    """transformers loads model_type qwen2 with its own Qwen2Tokenizer; it must agree with the file."""
    _, path, _, tok = built
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in [*ROUNDTRIP, CHATML_HI, "cafe\u0301 12,345.6"]:  # NFD input: the NFC step must match
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_chat_template(built):
    _, _, _, tok = built
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == CHATML_HI
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode(CHATML_HI, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token_id in ids  # <|im_end|> is one token


def test_greedy_decoding_is_not_degenerate(built):
    _, _, model, tok = built
    outs = []
    for prompt in ["def main():", "The capital of France is", "héllo 世界"]:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        new = []
        with torch.no_grad():
            for _ in range(16):
                logits = model(ids).logits[0, -1]
                assert torch.isfinite(logits).all()
                nxt = int(logits.argmax())
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert len(set(new)) >= 6, new
        outs.append(tuple(new))
    assert len(set(outs)) == len(outs)


def test_same_inputs_give_identical_bytes(tmp_path):
    a = make_demo_model(tmp_path / "a", arch="qwen2", seed=3)
    b = make_demo_model(tmp_path / "b", arch="qwen2", seed=3)
    c = make_demo_model(tmp_path / "c", arch="qwen2", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(files)
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_rejects_unknown_arch_and_size(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_demo_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="size"):
        make_demo_model(tmp_path, size="huge")


def test_cli_make_demo_model(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-demo-model", str(out), "--arch", "qwen3"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert (out / "model.safetensors").is_file()
    assert capsys.readouterr().out.strip() == str(out)
