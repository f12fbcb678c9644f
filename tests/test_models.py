"""The offline tiny model: deterministic, loads like a real checkpoint, identical logits after reload."""

import hashlib
import string
from pathlib import Path

import pytest
import torch

from molt_hpc.config import MoltConfig
from molt_hpc.models import SPECIALS, build_tiny, load_causal_lm, load_tokenizer, resolve_model


def test_tokenizer_is_one_token_per_character(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    assert len(tok) == len(SPECIALS) + len(string.printable)
    text = "Reverse: abc\n 1+2=3"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_chat_template_and_special_tokens(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    # A policy must not be able to spell text by emitting special tokens.
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_vocab_matches_tokenizer(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id


def test_round_trip_gives_identical_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path / "again", safe_serialization=True)
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "again")
    with torch.no_grad():
        after = load_causal_lm(tmp_path / "again")(ids).logits
    assert torch.equal(before, after)


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    tiny = MoltConfig().model.tiny

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = digest(build_tiny(tmp_path / "a", tiny))
    b = digest(build_tiny(tmp_path / "b", tiny))
    c = digest(build_tiny(tmp_path / "c", tiny.model_copy(update={"init_seed": 1})))
    assert a == b != c


def test_resolve_builds_once_and_rejects_bad_paths(tmp_path: Path) -> None:
    cfg = MoltConfig().model
    first = resolve_model(cfg, tmp_path)
    assert resolve_model(cfg, tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(cfg.model_copy(update={"path": str(tmp_path / "nope")}), tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(cfg.model_copy(update={"path": str(tmp_path)}), tmp_path)
    with pytest.raises(ValueError, match=r"the builtin models are .*'builtin:tiny-char'"):
        resolve_model(cfg.model_copy(update={"path": "builtin:huge"}), tmp_path)


def test_build_tiny_command(tmp_path: Path) -> None:
    from tests.conftest import molt

    result = molt("model", "build-tiny", str(tmp_path / "m"), "--set", "model.tiny.num_layers=1")
    assert result.returncode == 0, result.stderr
    assert load_causal_lm(tmp_path / "m").config.num_hidden_layers == 1
