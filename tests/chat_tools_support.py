"""A model whose replies the tool-calling tests know in advance: the tiny model's tokenizer and chat template,
plus a few whole tool-call pieces as single tokens, and a Qwen3 whose next token depends on the last one only.

Every attention and MLP weight is zero, so the residual stream at each position is the last token's
embedding (a one-hot row); the untied LM head maps it to its successor with a logit of ~340, so sampling
at any temperature picks the successor (log-prob 0.0 in float32). Successors: after the space that
ends a named function's forced prefix, the call's arguments (`ARGS`); after the quote that ends
`tool_choice = "required"`'s prefix, a call whose arguments are not an object (`BAD`); after the newline
that ends every generation prompt, the answer `5`; after each of those, the end-of-turn token; every
other token ends the turn at once. The chat template writes a call exactly as `ARGS` continues its
prefix, so the next turn's prompt re-renders the call into the tokens the engine produced.
"""

from pathlib import Path

from molt_hpc.models.tiny_char import HERMES_CALL, chat_template

FORMATS = {
    "hermes": {
        "args": '{"a": 2, "b": 3}}\n</tool_call>',
        "bad": 'add", "arguments": [2, 3]}\n</tool_call>',
        "call": HERMES_CALL,
    },
    "llama3": {
        "args": '{"a": 2, "b": 3}}',
        "bad": 'add", "parameters": [2, 3]}',
        "call": '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}',
    },
}


def build_tool_model(out: Path, fmt: str) -> Path:
    """The model directory for tool-call format `fmt` (`hermes` or `llama3`)."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, Qwen3Config

    from molt_hpc.models.tiny_char import build_tiny_tokenizer, save_tiny

    spec = FORMATS[fmt]
    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken(spec[k], normalized=False, special=False) for k in ("args", "bad")])
    tok.chat_template = chat_template(spec["call"])
    vocab = len(tok)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, dtype="float32",
    )  # fmt: skip
    assert vocab <= config.hidden_size, "one-hot embeddings need a dimension per token"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = tok.convert_tokens_to_ids
    successor = {i: tok.eos_token_id for i in range(vocab)}
    successor |= {ids(" "): ids(spec["args"]), ids('"'): ids(spec["bad"]), ids("\n"): ids("5")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for i, j in successor.items():
            model.lm_head.weight[j, i] = 30.0
    return save_tiny(model, tok, out)
