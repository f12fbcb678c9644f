"""The datasets users already have: Parquet files and `datasets.save_to_disk` directories (written by the real
pyarrow and `datasets`), dotted keys into the verl layout, read by the RL prompts, the SFT rows and the pre-flight."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from molt_hpc.config.model import DataConfig
from molt_hpc.data import PromptDataset
from molt_hpc.datasets.rows import read_rows
from molt_hpc.launch.preflight import PreflightError
from molt_hpc.launch.preflight.data import check_rows
from molt_hpc.models import build_tiny_tokenizer
from molt_hpc.readers import MISSING, iter_rows, row_value

VERL = [
    {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"add {i} and {i}"}],
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i},
    }
    for i in range(6)
]
KEYS = {"prompt_key": "prompt", "label_key": "reward_model.ground_truth"}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)  # two row groups
    return path


def test_dotted_keys() -> None:
    row = {"a": {"b": {"c": 1}}, "x.y": 2, "x": {"y": 3}}
    assert row_value(row, "a.b.c") == 1 and row_value(row, "a.b") == {"c": 1}
    assert row_value(row, "x.y") == 2  # the key as written wins
    assert row_value(row, "a.q") is MISSING and row_value(row, "a.b.c.d") is MISSING


def test_a_verl_parquet_file_loads_with_dotted_keys(tok, tmp_path: Path) -> None:
    path = parquet(tmp_path / "train.parquet", VERL)
    ds = PromptDataset.load(DataConfig(path=str(path), max_prompt_tokens=128, **KEYS), tok)
    assert [p.label for p in ds.prompts] == [str(2 * i) for i in range(6)]
    assert [p.prompt for p in ds.prompts] == [r["prompt"] for r in VERL]
    assert [p.prompt_id for p in ds.prompts] == [f"train.parquet:{i}" for i in range(1, 7)]
    assert ds.prompts[3].extra["extra_info"] == {"index": 3}
    assert check_rows(DataConfig(path=str(path), max_prompt_tokens=128, **KEYS), tok, str(path), "data.path") == []


def test_a_save_to_disk_directory_loads(tok, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # in the dev extra
    datasets.Dataset.from_list(VERL).save_to_disk(str(tmp_path / "train"))
    ds = PromptDataset.load(DataConfig(path=str(tmp_path / "train"), max_prompt_tokens=128, **KEYS), tok)
    assert [p.label for p in ds.prompts] == [str(2 * i) for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL)}).save_to_disk(str(tmp_path / "all"))
    with pytest.raises(ValueError, match=r"holds the splits \['train'\] \(a DatasetDict\): name one"):
        PromptDataset.load(DataConfig(path=str(tmp_path / "all"), **KEYS), tok)
    assert [row for _, row, _ in iter_rows(tmp_path / "train")] == [
        {**r, "reward_model": r["reward_model"]} for r in VERL
    ]


def test_a_missing_dotted_key_names_the_row(tok, tmp_path: Path) -> None:
    # (Parquet gives every row the file's columns, absent values as null: a missing key is one the file lacks.)
    rows = [{**r, "reward_model": {"style": "rule"}} for r in VERL]
    path = parquet(tmp_path / "bad.parquet", rows)
    cfg = DataConfig(path=str(path), max_prompt_tokens=128, **KEYS)
    with pytest.raises(ValueError, match=r"bad.parquet, row 1: missing 'reward_model.ground_truth'; fix the row"):
        PromptDataset.load(cfg, tok)
    with pytest.raises(
        PreflightError, match=r"^data.path = '.*bad.parquet': row 1: missing 'reward_model.ground_truth'"
    ):
        check_rows(cfg, tok, str(path), "data.path")
    not_parquet = tmp_path / "junk.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(PreflightError, match="cannot be read as parquet"):
        check_rows(cfg, None, str(not_parquet), "data.path")


def test_the_stage_reader_takes_parquet(tmp_path: Path) -> None:
    path = parquet(tmp_path / "sft.parquet", [{"prompt": "p", "completion": str(i)} for i in range(5)])
    rows, bad = read_rows(path, lambda row, row_id: (row_id, row["completion"]), "error")
    assert rows == [(f"sft.parquet:{i + 1}", str(i)) for i in range(5)] and not bad
