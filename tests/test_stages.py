"""SFT and reward-model training on the real trainer: one step on two gloo ranks with packed rows gives
the loss and gradient norm of one rank on padded rows (the global means), and the reward checkpoint
is an HF sequence-classification model whose scores and saved statistics a plain transformers load
reproduces.

Real parts: the tiny model built offline, the shipped reversal data, the `Trainer` with FSDP2 and
its micro-batching, torch.distributed gloo groups of 1 and 2 processes (`tests.ranks.spawn_ranks`).
"""

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.ranks import spawn_ranks

ONE = ("actor.packing='off'", "actor.micro_batch_size=3")  # padded rows, several micro-batches
TWO = ("actor.packing='on'", "actor.max_tokens_per_micro_batch=96")  # packed rows dealt to two ranks


def stage_config(tmp: Path, model_dir: Path, stage: str, layout: tuple[str, ...], size: int = 1):
    from molt_hpc.config import load_config

    data = {"sft": ("reverse_sft_train", "reverse_sft_eval"), "rm": ("reverse_prefs_train", "reverse_prefs_eval")}
    train, held_out = (ROOT / "data" / f"{name}.jsonl" for name in data[stage])
    sets = [f"run.root='{tmp}'", f"run.name='{stage}-w{size}'", f"run.stage='{stage}'", f"model.path='{model_dir}'",
            f"{stage}.data='{train}'", f"{stage}.eval_data='{held_out}'", f"{stage}.batch_size=10",
            f"{stage}.max_tokens=48", f"{stage}.eval_max_rows=24", "actor.device='cpu'", "actor.grad_clip=1e9",
            "run.steps=4", *layout]  # fmt: skip
    return load_config(None, sets)


def _worker(rank: int, size: int, port: int, tmp: str, model_dir: str, layout: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    from molt_hpc.actor.supervised import StageTask, make_stage
    from molt_hpc.actor.trainer import Trainer
    from molt_hpc.actor.world import close_world, init_world
    from molt_hpc.config import to_toml
    from molt_hpc.rundir import create_run_dir

    results = {}
    for stage in ("sft", "rm"):
        cfg = stage_config(Path(tmp), Path(model_dir), stage, layout, size)
        run = create_run_dir(cfg.run.root, cfg.run.name, to_toml(cfg)) if rank == 0 else None
        world = init_world(cfg.actor)
        dist.barrier()
        from molt_hpc.rundir import RunDir

        task = StageTask(cfg, world, make_stage(cfg))
        trainer = Trainer(cfg, run or RunDir(Path(cfg.run.root) / cfg.run.name), world, task, False)
        step = trainer.train(task.order.take(cfg.sft.batch_size if stage == "sft" else cfg.rm.batch_size), 0.0)
        step.update(task.evaluate(trainer.step))
        trainer.checkpoint()
        results[stage] = step
        trainer.close()
    close_world()  # once: the stages share the world (a second group on the same port races the first's store)
    if rank == 0:
        Path(tmp, f"result-{size}.json").write_text(json.dumps(results))


def run_world(tmp: Path, model_dir: Path, size: int, layout: tuple[str, ...]) -> dict:
    from molt_hpc.net import free_port

    spawn_ranks(_worker, (size, free_port("127.0.0.1"), str(tmp), str(model_dir), layout), size)
    return json.loads((tmp / f"result-{size}.json").read_text())


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("stages")
    return tmp, run_world(tmp, tiny_model_dir, 1, ONE), run_world(tmp, tiny_model_dir, 2, TWO)


def test_one_step_is_the_same_on_two_packed_ranks(worlds) -> None:
    _, one, two = worlds
    for stage, loss in (("sft", "sft_loss"), ("rm", "rm_loss")):
        for key in (loss, "grad_norm", "eval_loss"):
            assert one[stage][key] == pytest.approx(two[stage][key], rel=1e-5, abs=1e-6), (stage, key)
        assert one[stage]["grad_norm"] > 1e-3
    assert one["sft"]["supervised_tokens"] == two["sft"]["supervised_tokens"] > 0
    assert one["rm"]["rm_accuracy"] == pytest.approx(two["rm"]["rm_accuracy"])


def test_reward_checkpoint_is_a_sequence_classifier(worlds, tiny_model_dir) -> None:
    """Loaded by plain transformers, it scores each held-out side at its last token; the mean and std in its
    config are those scores' (as the trainer's evaluation reported them)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from molt_hpc.datasets import PreferenceDataset, ReplyMarkers
    from molt_hpc.models.resolve import run_model
    from molt_hpc.models.reward import MEAN_KEY, STD_KEY, reward_stats

    tmp, one, _ = worlds
    cfg = stage_config(tmp, tiny_model_dir, "rm", ONE)
    path = run_model(tmp / "rm-w1", "reward")
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    assert model.config.architectures == ["Qwen3ForSequenceClassification"]  # what vLLM serves it by
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    pairs = PreferenceDataset.load(cfg.rm.eval_data, cfg.rm, tok, ReplyMarkers.probe(tok), limit=24).pairs
    scores = []
    with torch.no_grad():
        for p in pairs:  # one unpadded sequence at a time: transformers' pooling reads its last token
            scores += [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in (p.chosen, p.rejected)]
    mean, std = reward_stats(path)
    assert mean == pytest.approx(statistics.fmean(scores), abs=1e-5) == pytest.approx(one["rm"]["eval_score_mean"])
    assert std == pytest.approx(statistics.stdev(scores), abs=1e-5)
    accuracy = statistics.fmean(float(scores[2 * i] > scores[2 * i + 1]) for i in range(len(pairs)))
    assert accuracy == pytest.approx(one["rm"]["eval_accuracy"])
    saved = json.loads((path / "config.json").read_text())
    assert saved[MEAN_KEY] == mean and saved[STD_KEY] == std


def test_sft_checkpoint_is_a_causal_lm(worlds) -> None:
    from transformers import AutoModelForCausalLM

    from molt_hpc.models.resolve import run_model

    tmp, _, _ = worlds
    model = AutoModelForCausalLM.from_pretrained(run_model(tmp / "sft-w2", "policy"), local_files_only=True)
    assert model.config.vocab_size == 104
