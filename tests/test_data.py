"""The prompt dataset: row checks, chat templating, length-balanced order and a resumable cursor."""

import json
from collections import Counter
from pathlib import Path

import pytest

from molt_hpc.config.model import DataConfig
from molt_hpc.data import Cursor, Position, PromptDataset, epoch_order, render_prompt
from molt_hpc.models import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_loads_text_and_chat_rows_through_the_template(tok, tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "d.jsonl",
        [
            {"prompt": "hi", "label": 1, "id": "a"},
            {"prompt": [{"role": "user", "content": "yo"}], "label": "x", "tools": [{"name": "calc"}]},
            {"prompt": "extra", "label": None, "files": ["a.txt"], "meta": {"k": 1}},
        ],
    )
    ds = PromptDataset.load(DataConfig(path=str(path), system_prompt="Be brief.", max_prompt_tokens=512), tok)
    assert [p.prompt_id for p in ds.prompts] == ["a", "d.jsonl:2", "d.jsonl:3"]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ds[0].token_ids) == want
    assert ds[1].extra["tools"] == [{"name": "calc"}]
    assert '<tools>\n{"name": "calc"}\n</tools>' in tok.decode(ds[1].token_ids)  # the template writes the row's tools
    assert ds[2].extra == {"files": ["a.txt"], "meta": {"k": 1}}  # extra keys ride along for later use
    raw = PromptDataset.load(DataConfig(path=str(path), apply_chat_template=False), tok, limit=1)
    assert tok.decode(raw[0].token_ids) == "hi"


def test_a_system_message_in_the_row_wins_over_the_config(tok) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    ids = render_prompt(tok, messages, system_prompt="other")
    assert "other" not in tok.decode(ids) and "S" in tok.decode(ids)


BAD_ROWS = [
    ("not json", "invalid JSON"),
    ('["a list"]', "must be a JSON object"),
    ({"label": 1}, "missing 'prompt'"),
    ({"prompt": "p"}, "missing 'label'"),
    ({"prompt": 3, "label": 1}, "must be text or a non-empty list"),
    ({"prompt": "   ", "label": 1}, "is empty"),
    ({"prompt": [{"role": "robot", "content": "x"}], "label": 1}, "role in"),
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "label": 1}, "vision"),
    ({"prompt": "p", "label": 1, "tools": "calc"}, "'tools' must be a list"),
    ({"prompt": "x" * 200, "label": 1}, "too long"),
]


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_a_bad_row_is_an_error_naming_file_and_line(tok, tmp_path: Path, row, message: str) -> None:
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": 0}, row])
    with pytest.raises(ValueError, match=rf"bad.jsonl, line 2: .*{message}.*on_bad_row") as err:
        PromptDataset.load(DataConfig(path=str(path)), tok)
    assert str(path) in str(err.value)


def test_bad_rows_are_skipped_and_counted_when_asked(tok, tmp_path: Path) -> None:
    rows = [{"prompt": "ok", "label": 0}] + [row for row, _ in BAD_ROWS] + ["", {"prompt": "fine", "label": 2}]
    path = write_rows(tmp_path / "mixed.jsonl", rows)
    ds = PromptDataset.load(DataConfig(path=str(path), on_bad_row="skip"), tok)
    assert [p.label for p in ds.prompts] == [0, 2]
    assert sum(ds.bad_rows.values()) == len(BAD_ROWS)


def test_missing_file_and_empty_dataset_are_clear_errors(tok, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        PromptDataset.load(DataConfig(path=str(tmp_path / "nope.jsonl")), tok)
    with pytest.raises(ValueError, match="not found"):
        PromptDataset.load(DataConfig(path=str(tmp_path / "x.parquet")), tok)
    with pytest.raises(ValueError, match="no usable rows"):
        PromptDataset.load(DataConfig(path=str(write_rows(tmp_path / "e.jsonl", ["  "]))), tok)


def test_epoch_order_is_length_balanced_and_a_permutation() -> None:
    lengths = [i % 20 for i in range(100)]
    order = epoch_order(lengths, buckets=4, seed=3, epoch=0)
    assert sorted(order) == list(range(100))
    ranked = sorted(range(100), key=lambda i: (lengths[i], i))
    bucket_of = {row: b for b in range(4) for row in ranked[b * 25 : (b + 1) * 25]}
    # Every run of 4 consecutive draws takes one prompt from each length bucket.
    for start in range(0, 100, 4):
        assert sorted(bucket_of[r] for r in order[start : start + 4]) == [0, 1, 2, 3]
    assert order == epoch_order(lengths, buckets=4, seed=3, epoch=0)
    assert order != epoch_order(lengths, buckets=4, seed=3, epoch=1)
    assert order != epoch_order(lengths, buckets=4, seed=4, epoch=0)
    assert epoch_order(lengths, buckets=1, seed=0, epoch=0, shuffle=False) == ranked


def test_cursor_resume_skips_and_repeats_nothing(tok) -> None:
    cfg = DataConfig(path=str(ROOT / "data" / "reverse_train.jsonl"))
    ds = PromptDataset.load(cfg, tok, limit=37)
    straight = Cursor(ds, cfg, seed=5)
    expected = [straight.next() for _ in range(100)]
    drawn, cursor = [], Cursor(ds, cfg, seed=5)
    for stop_at in (13, 40, 74, 100):  # save, "crash", restore in a new cursor, go on
        while len(drawn) < stop_at:
            drawn.append(cursor.next())
        saved = json.loads(json.dumps(cursor.state()))
        cursor = Cursor(ds, cfg, seed=5)
        cursor.restore(saved)
    assert drawn == expected
    assert [pos for _, pos in drawn[:38]] == [Position(0, i) for i in range(37)] + [Position(1, 0)]
    # Each epoch visits every row exactly once.
    assert Counter(p.prompt_id for p, pos in drawn if pos.epoch == 1) == Counter(p.prompt_id for p in ds.prompts)
    assert cursor.at(Position(2, 5)) == expected[2 * 37 + 5][0]
    assert Position(2, 5).group_id == "e2-i5"


def test_cursor_refuses_another_dataset_or_seed(tok) -> None:
    cfg = DataConfig(path=str(ROOT / "data" / "reverse_train.jsonl"))
    saved = Cursor(PromptDataset.load(cfg, tok, limit=10), cfg, seed=0).state()
    with pytest.raises(ValueError, match="another dataset or seed"):
        Cursor(PromptDataset.load(cfg, tok, limit=11), cfg, seed=0).restore(saved)
    with pytest.raises(ValueError, match="another dataset or seed"):
        Cursor(PromptDataset.load(cfg, tok, limit=10), cfg, seed=1).restore(saved)
