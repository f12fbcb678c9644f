"""SFT and preference rows: the reply mask found from three chat templates (none with generation tags),
the trace-shaped token ids, bad rows, and the length-balanced resumable step order.

The templates are real ones written out as strings: the tiny model's ChatML, Llama-3-Instruct's and a
Qwen3-style one whose last reply after the last user turn carries an empty think block. Expected
values are computed independently: from the rendered text (what the template wrote around each
reply) and from `molt_hpc.data.render_prompt` (the tokens an RL rollout's prompt has).
"""

import json
import logging

import pytest

from molt_hpc.config.stages import RewardTrainConfig, SftConfig
from molt_hpc.data import render_prompt
from molt_hpc.datasets import PreferenceDataset, ReplyMarkers, RowProblem, SftDataset, StepOrder, encode_chat
from molt_hpc.models import build_tiny_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "Reverse: ab"},
    {"role": "assistant", "content": "ba"},
]


def llama3_tokenizer():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})  # fmt: skip
    tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA3
    return tok


def qwen3_tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = QWEN3
    return tok


TEMPLATES = {
    "chatml": (build_tiny_tokenizer, "<|im_start|>assistant\n", "<|im_end|>", "{}"),
    "llama3": (llama3_tokenizer, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", "{}"),
    # Qwen3 writes an empty think block into the reply after the last user turn: the model produces it too.
    "qwen3": (qwen3_tokenizer, "<|im_start|>assistant\n", "<|im_end|>", "<think>\n\n</think>\n\n{}"),
}


@pytest.fixture(params=sorted(TEMPLATES))
def template(request):
    make, opener, stop, last_reply = TEMPLATES[request.param]
    tok = make()
    return tok, ReplyMarkers.probe(tok), opener, stop, last_reply


def replies_text(tok, enc) -> list[str]:
    return [tok.decode(enc.token_ids[s:e], skip_special_tokens=False) for s, e in enc.replies]


def test_markers_come_from_the_template(template) -> None:
    _, markers, opener, stop, _ = template
    assert (markers.opener, markers.stop) == (opener, stop)


def test_every_reply_and_its_stop_token_are_supervised(template) -> None:
    tok, markers, _, stop, last_reply = template
    enc = encode_chat(tok, markers, CHAT, [True, True])
    assert replies_text(tok, enc) == ["cba" + stop, last_reply.format("ba") + stop]
    # the ids spell the template's own rendering, up to the last reply's stop token (its glue is not trained)
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    text = tok.decode(enc.token_ids, skip_special_tokens=False)
    assert rendered.startswith(text) and text.endswith(last_reply.format("ba") + stop)
    assert enc.supervised == sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in replies_text(tok, enc))


def test_last_only_and_prompt_completion_rows(template) -> None:
    tok, markers, _, stop, last_reply = template
    enc = encode_chat(tok, markers, CHAT, [False, True])
    assert replies_text(tok, enc) == [last_reply.format("ba") + stop]
    # a single-turn row is an RL trace: the prompt's tokens are exactly what a rollout's prompt holds
    prompt = [{"role": "user", "content": "Reverse: abcd"}]
    enc = encode_chat(tok, markers, [*prompt, {"role": "assistant", "content": "dcba"}], [True])
    start = enc.replies[0][0]
    assert enc.token_ids[:start] == render_prompt(tok, prompt)
    assert replies_text(tok, enc) == [last_reply.format("dcba") + stop]


def test_sft_file_rows_and_bad_rows(tmp_path, caplog) -> None:
    tok = build_tiny_tokenizer()
    markers = ReplyMarkers.probe(tok)
    rows = [
        {"messages": CHAT},
        {"prompt": [{"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ba"},
                    {"role": "user", "content": "Reverse: cd"}], "completion": "dc"},  # few-shot prompt
        {"prompt": "Reverse: abcd", "completion": {"role": "assistant", "content": "dcba"}},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"prompt": "x" * 300, "completion": "y"},
        {"messages": [{"role": "robot", "content": "?"}]},
    ]  # fmt: skip
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    cfg = SftConfig(data=str(path), max_tokens=128, on_bad_row="skip")
    with caplog.at_level(logging.WARNING, logger="molt_hpc"):
        ds = SftDataset.load(str(path), cfg, tok, markers)
    assert len(ds) == 3
    assert [replies_text(tok, s) for s in ds.samples] == [["cba<|im_end|>", "ba<|im_end|>"], ["dc<|im_end|>"],
                                                          ["dcba<|im_end|>"]]  # fmt: skip
    assert sum(ds.bad_rows.values()) == 4 and "too long" in ds.bad_rows and "invalid JSON" in ds.bad_rows
    with pytest.raises(ValueError, match=r"sft.jsonl, line 4: no assistant reply to train on"):
        SftDataset.load(str(path), SftConfig(data=str(path)), tok, markers)


def test_truncate_keeps_whole_replies_only() -> None:
    from molt_hpc.datasets.sft import fit

    tok = build_tiny_tokenizer()
    enc = encode_chat(tok, ReplyMarkers.probe(tok), CHAT, [True, True])
    cut = fit(enc, enc.replies[1][0] + 1, truncate=True)  # the second reply does not fit whole
    assert cut.replies == enc.replies[:1] and cut.token_ids == enc.token_ids[: enc.replies[0][1]]
    with pytest.raises(RowProblem, match="on_overlong = 'truncate'"):
        fit(enc, enc.replies[1][0] + 1, truncate=False)
    with pytest.raises(RowProblem, match="no whole reply"):
        fit(enc, enc.replies[0][0] + 1, truncate=True)


def test_preference_pairs_end_at_the_stop_token(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    rows = [
        {"prompt": "Reverse: ab", "chosen": "ba", "rejected": "ab", "margin": 0.5},
        {"chosen": [{"role": "user", "content": "Reverse: cd"}, {"role": "assistant", "content": "dc"}],
         "rejected": [{"role": "user", "content": "Reverse: cd"}, {"role": "assistant", "content": "cd"}]},
        {"prompt": "Reverse: ab", "chosen": "ba", "rejected": "ba"},
    ]  # fmt: skip
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PreferenceDataset.load(str(path), RewardTrainConfig(data=str(path), on_bad_row="skip"), tok,
                                ReplyMarkers.probe(tok))  # fmt: skip
    assert dict(ds.bad_rows) == {"'chosen' and 'rejected' are the same": 1}
    first = ds.pairs[0]
    prompt = render_prompt(tok, "Reverse: ab")
    assert first.chosen == prompt + tok("ba<|im_end|>", add_special_tokens=False)["input_ids"]
    assert first.rejected[-1] == tok.eos_token_id and first.margin == 0.5
    assert ds.pairs[1].chosen == render_prompt(tok, "Reverse: cd") + tok("dc<|im_end|>")["input_ids"]
    no_margin = RewardTrainConfig(data=str(path), on_bad_row="skip", margin=False)
    assert PreferenceDataset.load(str(path), no_margin, tok, ReplyMarkers.probe(tok)).pairs[0].margin == 0.0


def test_step_order_is_length_balanced_and_resumable() -> None:
    lengths = [3, 9, 1, 7, 5, 2, 8, 4, 6, 10]
    order = StepOrder(lengths, buckets=2, seed=1, key="k")
    first = order.take(4) + order.take(4) + order.take(4)  # crosses into epoch 1
    assert sorted(first[:10]) == list(range(10)) and order.epoch == 1
    assert all((lengths[a] <= 5) != (lengths[b] <= 5) for a, b in zip(first[:10:2], first[1:10:2], strict=True))
    again = StepOrder(lengths, buckets=2, seed=1, key="k")
    again.take(5)
    saved = again.state()
    resumed = StepOrder(lengths, buckets=2, seed=1, key="k")
    resumed.restore(saved)
    assert resumed.take(7) == first[5:12]
    with pytest.raises(ValueError, match="another data file or seed"):
        StepOrder(lengths, buckets=2, seed=2, key="k").restore(saved)
