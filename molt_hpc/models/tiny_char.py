"""`builtin:tiny-char`: the offline tiny model.

It is a character-level tokenizer (one token per printable ASCII character plus four specials, a
ChatML chat template that writes tools and tool calls as Qwen 2.5 does) and a random-init Qwen3
whose vocabulary is exactly the tokenizer's, saved in HF layout with safetensors. Every other part
of molt-hpc loads it the way it would load a real checkpoint, so the tiny model exercises the real
code paths. Nothing here ever reaches a hub: loads pass `local_files_only`.
"""

import string
from pathlib import Path

from molt_hpc.config.model import TinyModelConfig
from molt_hpc.hf_logging import quiet_transformers

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>{% for tool in tools %}{{ '\\n' }}"
    "{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
HERMES_CALL = (
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>"
)


def chat_template(tool_call: str = HERMES_CALL) -> str:
    """ChatML, with tools the way Qwen 2.5 writes them: the functions in the system turn, each call of an
    assistant turn written by `tool_call` (Jinja over `call`). Without tools and tool calls it is plain
    ChatML, `<|im_start|>role\ncontent<|im_end|>\n` per message. (Chat templates render with `trim_blocks`: a
    newline right after a block tag is written as `{{ '\\n' }}`.)"""
    return (
        "{% set skip_system = tools and messages[0]['role'] == 'system' %}{% if tools %}<|im_start|>system\n"
        "{% if skip_system %}{{ messages[0]['content'] }}\n\n{% endif %}" + TOOLS_SYSTEM + "<|im_end|>\n{% endif %}"
        "{% for message in messages %}{% if not (loop.first and skip_system) %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
        "{% for call in message['tool_calls'] or [] %}"
        "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
        + tool_call
        + "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = chat_template()


def build_tiny_tokenizer():
    """The character-level tokenizer, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def tiny_config(tiny: TinyModelConfig, vocab_size: int | None = None):
    """The transformers config of `builtin:tiny-char` for `tiny` (the vocabulary is the tokenizer's)."""
    from transformers import Qwen3Config

    if vocab_size is None:
        vocab_size = len(build_tiny_tokenizer())
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=SPECIALS.index("<pad>"),
        eos_token_id=SPECIALS.index("<|im_end|>"),
        bos_token_id=None,
        dtype="float32",
    )


def build_tiny(out_dir: str | Path, tiny: TinyModelConfig) -> Path:
    """Write the tiny model (weights from `tiny.init_seed`) and its tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tiny, len(tokenizer))
    assert (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_tiny(model, tokenizer, out)


def save_tiny(model, tokenizer, out: Path) -> Path:
    """Write a tiny model and its tokenizer as an HF directory (safetensors), sampling by default with
    the tokenizer's pad and eos ids, as every tiny builtin is saved."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, top_k=0, do_sample=True
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
