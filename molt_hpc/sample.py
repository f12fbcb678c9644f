"""One sampled reply from the configured model: a quick check that a model source loads and generates."""

import tempfile

from molt_hpc.config import MoltConfig
from molt_hpc.models import load_causal_lm, load_tokenizer, resolve_model


def sample_reply(cfg: MoltConfig, prompt: str, max_new_tokens: int | None = None) -> str:
    import torch

    cache = tempfile.mkdtemp(prefix="molt-model-") if cfg.model.is_builtin else None
    path = resolve_model(cfg.model, cache or ".")
    tok = load_tokenizer(path)
    model = load_causal_lm(path, dtype=cfg.model.dtype)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(cfg.run.seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=cfg.rollout.temperature,
        top_k=0,
        max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens,
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
