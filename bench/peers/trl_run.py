"""One TRL `GRPOTrainer` run of the peer benchmark, in its own process, stopped by a wall-clock budget.

The clock starts when the driver started this process (`--t0`) and stops while the held-out evaluation runs:
evaluation time is excluded from TRL's budget (molt-hpc's runs beside its training, as shipped). The run stops
at the step boundary where the next step would end past the budget, after a last evaluation. Everything it
measures goes to `events.jsonl` in `--out`: evaluations (pass@k as molt-hpc computes it), steps (generated
and trained completion tokens so far), notes.

    python bench/peers/trl_run.py --config configs/tiny_cpu.toml --out runs/peers/trl-s0 --t0 $(date +%s.%N)
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import EnvScorer, bench_config, load_rows, model_dir, trl_prompt, trl_reward
from mapping import differences, grpo_changes
from transformers import TrainerCallback

from molt_hpc.rollout.evaluation import pass_at_k

EVAL_CHUNK = 256
"""Sequences generated together in one evaluation batch."""


class Events:
    """The run's `events.jsonl` and its clock: seconds since `t0`, less the time spent evaluating."""

    def __init__(self, path: Path, t0: float):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - held for the process's life
        self.t0, self.paused = t0, 0.0

    def now(self) -> float:
        return time.time() - self.t0 - self.paused

    def write(self, kind: str, t: float | None = None, **fields) -> None:
        at = self.now() if t is None else t
        self.file.write(json.dumps({"kind": kind, "t": round(at, 3), **fields}) + "\n")


def generate_held_out(model, rows, n: int, ev, max_new: int, pad_id: int, eos_id: int) -> list[list[int]]:
    """`n` completions of every held-out row (row-major), sampled as the evaluation asks."""
    import torch

    jobs = [p.token_ids for p in rows for _ in range(n)]
    sample = ev.temperature > 0
    kwargs = {"temperature": ev.temperature, "top_p": ev.top_p, "top_k": 0} if sample else {}
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for start in range(0, len(jobs), EVAL_CHUNK):
        chunk = jobs[start : start + EVAL_CHUNK]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(j)) + j for j in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(j)) + [1] * len(j) for j in chunk], device=device)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=sample, max_new_tokens=max_new,
            eos_token_id=eos_id, pad_token_id=pad_id, **kwargs,
        )  # fmt: skip
        for row in gen[:, width:].tolist():
            out.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return out


class BudgetAndEval(TrainerCallback):
    """Held-out evaluation at the start, every `every_s` training seconds and at the stop; the budget's stop."""

    def __init__(self, cfg, rows, scorer: EnvScorer, events: Events, counter: dict, budget_s: float, every_s: float):
        self.cfg, self.rows, self.scorer, self.events, self.counter = cfg, rows, scorer, events, counter
        self.budget_s, self.every_s = budget_s, every_s
        self.last_step_t = self.last_eval_t = 0.0
        self.evals = 0

    def evaluate(self, model, step: int) -> None:
        import torch

        ev, tok = self.cfg.eval, self.scorer.tokenizer
        at, began = self.events.now(), time.time()
        model.eval()
        cuda = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.cfg.run.seed * 100_003 + self.evals)
            done = generate_held_out(model, self.rows, ev.n, ev, self.cfg.rollout.max_new_tokens,
                                     tok.pad_token_id or 0, tok.eos_token_id)  # fmt: skip
        model.train()
        overrides = {"temperature": ev.temperature, "top_p": ev.top_p}
        results = [self.scorer(self.rows[i // ev.n], ids, overrides) for i, ids in enumerate(done)]
        record = {"step": step, "seconds": round(time.time() - began, 3)}
        for k in ev.k:
            per_prompt = [sum(s >= ev.pass_threshold for _, s in results[i * ev.n : (i + 1) * ev.n])
                          for i in range(len(self.rows))]  # fmt: skip
            record[f"pass@{k}"] = statistics.fmean(pass_at_k(ev.n, c, k) for c in per_prompt)
        record["reward"] = statistics.fmean(r for r, _ in results)
        self.events.paused += time.time() - began  # evaluation is off the budget's clock
        self.events.write("eval", t=at, **record)  # at the clock's reading when these weights were evaluated
        self.last_eval_t = at
        self.evals += 1

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)
        self.last_step_t = self.events.now()  # the first step's duration excludes the start-up

    def on_step_end(self, args, state, control, model=None, **kwargs):
        t = self.events.now()
        step_s, self.last_step_t = t - self.last_step_t, t
        generated = self.counter.get("generated", 0)
        # One generation per optimizer step (steps_per_generation = gradient_accumulation_steps), every completion
        # token in the loss: by a step's end every token generated so far has been trained on.
        self.events.write("step", step=state.global_step, generated=generated, trained=generated, step_s=step_s)
        if t + step_s > self.budget_s:
            self.evaluate(model, state.global_step)
            self.events.write("stop", step=state.global_step, reason="budget")
            control.should_training_stop = True
        elif t - self.last_eval_t >= self.every_s:
            self.evaluate(model, state.global_step)


def build_trainer(args, cfg, events: Events):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from molt_hpc.models import load_tokenizer

    path = model_dir(cfg, Path(args.models))
    tokenizer = load_tokenizer(path)
    train, held = load_rows(cfg, tokenizer, Path(args.out))
    changes = grpo_changes(cfg, output_dir=str(Path(args.out) / "trainer"), seed=cfg.run.seed, use_vllm=args.vllm)
    grpo = GRPOConfig(**changes)
    print("GRPOConfig (full):", json.dumps(grpo.to_dict(), default=str, sort_keys=True), flush=True)
    data = Dataset.from_dict({"prompt": [trl_prompt(p, cfg) for p in train], "row_index": list(range(len(train)))})
    scorer, counter = EnvScorer(cfg, tokenizer), {}
    callback = BudgetAndEval(cfg, held, scorer, events, counter, args.budget_s, args.eval_every_s)
    trainer = GRPOTrainer(
        model=str(path), reward_funcs=trl_reward(scorer, train, counter), args=grpo, train_dataset=data,
        callbacks=[callback],
    )  # fmt: skip
    stops = sorted(set(trainer.eos_token_ids))
    if stops != [tokenizer.eos_token_id]:
        events.write("note", text=f"TRL stops generating at token ids {stops}, molt-hpc at {tokenizer.eos_token_id}")
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True, help="this run's folder")
    parser.add_argument("--models", required=True, help="the model cache (builtin models materialised there)")
    parser.add_argument("--t0", type=float, default=None, help="the clock's start (epoch seconds)")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--eval-every-s", type=float, default=30.0)
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM (TRL's colocate mode)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg, _ = bench_config(args.config, args.overrides)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    events = Events(Path(args.out) / "events.jsonl", args.t0 if args.t0 is not None else time.time())
    for text in differences(cfg, "trl-vllm" if args.vllm else "trl"):
        print("note:", text, flush=True)
    trainer = build_trainer(args, cfg, events)
    trainer.train()
    import torch

    if torch.cuda.is_available():
        events.write("memory", cuda_peak_allocated_gb=torch.cuda.max_memory_allocated() / 2**30,
                     cuda_peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30)  # fmt: skip
    events.write("end")


if __name__ == "__main__":
    main()
