"""The peer benchmark's fairness (bench/peers): the molt-hpc config maps onto TRL's GRPOConfig value for value,
TRL's other defaults stay, TRL tokenises the prompts as molt-hpc does, and TRL's reward is the env's.

Needs the bench's own requirements (`pip install -r bench/peers/requirements.txt`); skipped without TRL.
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is a bench requirement only: pip install -r bench/peers/requirements.txt")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from common import EnvScorer, bench_config, load_rows, model_dir, trl_prompt, trl_reward  # noqa: E402
from mapping import grpo_changes  # noqa: E402
from trl import GRPOConfig  # noqa: E402

OVERRIDES = [
    "actor.lr=1e-4",
    "actor.lr_schedule=cosine",
    "actor.min_lr_ratio=0.2",
    "actor.warmup_steps=3",
    "actor.groups_per_step=4",
    "actor.micro_batch_size=8",
    "actor.grad_clip=0.5",
    "algorithm.kl_coef=0.05",
    "algorithm.eps_high=0.3",
    "algorithm.loss_agg=seq-mean-token-mean",
    "rollout.n_samples=4",
    "rollout.temperature=0.7",
    "rollout.max_new_tokens=5",
]
DERIVED = {
    "generation_batch_size": "per-device batch x accumulation (the step's batch), derived by GRPOConfig",
    "steps_per_generation": "= gradient_accumulation_steps, derived by GRPOConfig",
    "gradient_checkpointing": "the deprecated alias that mirrors activation_checkpointing",
}


def test_grpo_config_takes_the_molt_values_and_keeps_trl_defaults_otherwise(tmp_path: Path) -> None:
    cfg, _ = bench_config(str(ROOT / "configs" / "tiny_cpu.toml"), OVERRIDES)
    changes = grpo_changes(cfg, output_dir=str(tmp_path), seed=7, use_vllm=False)
    got = GRPOConfig(**changes)
    assert (got.learning_rate, got.max_grad_norm, got.beta, got.temperature) == (1e-4, 0.5, 0.05, 0.7)
    assert (got.epsilon, got.epsilon_high, got.num_generations, got.max_completion_length) == (0.2, 0.3, 4, 5)
    assert got.per_device_train_batch_size * got.gradient_accumulation_steps == 4 * 4
    assert (got.per_device_train_batch_size, got.generation_batch_size) == (8, 16)  # one generation per step
    assert (got.loss_type, got.scale_rewards, got.importance_sampling_level) == ("grpo", "group", "token")
    assert got.lr_scheduler_type.value == "cosine_with_min_lr" and got.lr_scheduler_kwargs == {"min_lr_rate": 0.2}
    assert (got.warmup_steps, got.seed, got.bf16, got.fp16, got.activation_checkpointing) == (3, 7, False, False, False)
    assert got.use_vllm is False and got.top_k == 0 and got.top_p == 1.0
    default = GRPOConfig(output_dir=str(tmp_path), bf16=False).to_dict()  # TRL's bf16 default needs a GPU
    differ = {k for k, v in got.to_dict().items() if default[k] != v}
    assert differ - set(changes) <= set(DERIVED), differ - set(changes)


def test_loss_and_dtype_mapping() -> None:
    path = str(ROOT / "configs" / "tiny_cpu.toml")
    for agg, loss in [("token-mean", "dapo"), ("seq-mean-token-sum-norm", "dr_grpo")]:
        cfg, _ = bench_config(path, [f"algorithm.loss_agg={agg}"])
        assert grpo_changes(cfg, output_dir="o", seed=0, use_vllm=False)["loss_type"] == loss
    cfg, _ = bench_config(path, ["algorithm.advantage=dr_grpo", "model.dtype=bfloat16", "algorithm.policy_loss=gspo"])
    changes = grpo_changes(cfg, output_dir="o", seed=0, use_vllm=True)
    assert (changes["scale_rewards"], changes["bf16"], changes["importance_sampling_level"]) == (
        "none",
        True,
        "sequence",
    )
    assert changes["loss_type"] == "grpo" and changes["use_vllm"] is True  # GSPO's seq-mean-token-mean
    cfg, _ = bench_config(path, ["algorithm.advantage=rloo"])
    with pytest.raises(ValueError, match="grpo and dr_grpo"):
        grpo_changes(cfg, output_dir="o", seed=0, use_vllm=False)


def position_credit(answer: str, label: str) -> float:
    """The reverse task's reward, written apart: matching positions over the longer string."""
    answer = answer.strip()
    longest = max(len(answer), len(label))
    return 0.0 if longest == 0 else sum(answer[i] == label[i] for i in range(min(len(answer), len(label)))) / longest


def test_trl_sees_molt_prompt_ids_and_gets_the_env_reward(tmp_path: Path) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    cfg, _ = bench_config(str(ROOT / "configs" / "tiny_cpu.toml"), [])
    path = model_dir(cfg, tmp_path / "models")
    from molt_hpc.models import load_tokenizer

    tok = load_tokenizer(path)
    train, held = load_rows(cfg, tok, tmp_path)
    assert len(held) == 32 and cfg.eval is not None and cfg.eval.pass_threshold == 1.0
    rows = train[:3]
    counter: dict = {}
    reward = trl_reward(EnvScorer(cfg, tok), rows, counter)
    data = Dataset.from_list([{"prompt": trl_prompt(p, cfg)} for p in rows])
    args = GRPOConfig(**grpo_changes(cfg, output_dir=str(tmp_path / "trl"), seed=0, use_vllm=False))
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward, train_dataset=data, args=args)
    ids, _, _ = trainer._tokenize_prompts([trl_prompt(p, cfg) for p in rows])
    assert [list(x) for x in ids] == [p.token_ids for p in rows]
    label = str(rows[0].label)
    texts = [label, label[:-1] + "#", label + label[0], " " + label[::-1], ""]
    eos = tok.eos_token_id
    completions = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    completions[1] = completions[1][:-1]  # cut by the length cap: no EOS
    completions.append(tok("<|im_start|>", add_special_tokens=False)["input_ids"] + completions[0])
    inputs = [{"prompt": trl_prompt(rows[0], cfg), "row_index": 0} for _ in completions]
    want = [position_credit(t, label) for t in [*texts, label]]
    assert reward([], [], completions, [0] * len(completions)) == want
    got = trainer._calculate_rewards(inputs, [i["prompt"] for i in inputs], [None] * len(inputs), completions)
    assert torch.equal(got[:, 0].cpu(), torch.tensor(want, dtype=got.dtype))  # through TRL's own call
    assert want[0] == 1.0 and want[-1] == 1.0 and 0 < want[1] < 1  # a special token never spells an answer
    assert counter["generated"] == 2 * sum(map(len, completions))
