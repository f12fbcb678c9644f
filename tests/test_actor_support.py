"""Shared helpers of the actor tests: groups sampled from the tiny model itself, run directories.

The trainer is fed through a real replay buffer with `Group`s whose tokens and log-probs come from
HF `generate` on the same tiny model, so the tests need no orchestrator or engine. The one test
here checks that feed: the recorded log-probs equal a teacher-forced forward of the same model.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from molt_hpc.config import load_config, to_toml
from molt_hpc.trajectory import Group, Trajectory
from tests.conftest import ROOT

WORDS = ["abc", "hello", "xy", "torch", "reverse", "qq", "slurm", "gpu", "a", "fsdp"]


def sample_groups(model_dir: Path, n_groups: int, n_samples: int, *, seed: int = 0, max_new: int = 8,
                  version: int = 0, first: int = 0) -> list[Group]:  # fmt: skip
    """`n_groups` groups of `n_samples` completions sampled at T=1 with their exact log-probs.

    Each completion is cut at a length drawn from [2, max_new] (the tokens and log-probs kept are still
    exactly what the model produced), so samples have unequal token counts.
    """
    import torch

    from molt_hpc.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    groups = []
    for g in range(first, first + n_groups):
        chat = [{"role": "user", "content": f"Reverse: {WORDS[g % len(WORDS)]}"}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        out = model.generate(
            input_ids=torch.tensor([ids] * n_samples), attention_mask=torch.ones(n_samples, len(ids), dtype=torch.long),
            do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=max_new, eos_token_id=None,
            pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        logp = torch.stack([s.log_softmax(-1) for s in out.scores], dim=1)  # [n, new, V]
        new = out.sequences[:, len(ids) :]
        chosen = logp.gather(2, new[..., None])[..., 0]
        samples = []
        for i in range(n_samples):
            n = int(torch.randint(2, max_new + 1, (1,), generator=gen))
            resp = new[i, :n].tolist()
            traj = Trajectory(
                tokens=ids + resp, prompt_len=len(ids), action_ranges=[(len(ids), len(ids) + n)],
                action_logprobs=chosen[i, :n].tolist(), versions=[version] * n,
                reward=float(sum(resp) % 7) / 7.0, group_id=f"g{g:04d}", rollout_id=f"g{g:04d}-{i}",
            )  # fmt: skip
            samples.append(traj)
        groups.append(Group(f"g{g:04d}", f"p{g}", samples, data_position={"epoch": 0, "index": g}))
    return groups


def make_run(root: Path, name: str, model_dir: Path, overrides: list[str] = ()):
    """A run directory (private, with token and config.toml) for the tiny model at `model_dir`."""
    from molt_hpc.rundir import create_run_dir

    sets = [f'run.root="{root}"', f'run.name="{name}"', f'model.path="{model_dir}"', *overrides]
    cfg = load_config(None, sets)
    return cfg, create_run_dir(root, name, to_toml(cfg))


def put_groups(cfg, run, groups: list[Group]) -> None:
    from molt_hpc.buffer import open_buffer

    buf = open_buffer(cfg.buffer, run.path, producer_id="test")
    for g in groups:
        buf.put(g)


def torchrun(run_dir: Path, ranks: int, *args: str, wait: bool = True, timeout: float = 120, env: dict | None = None):
    """`torchrun --nproc-per-node RANKS jobs/actor.py RUN_DIR ARGS` (a Popen when `wait` is False)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        str(ROOT / "jobs" / "actor.py"), str(run_dir), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(Path(run_dir) / "logs" / f"torchrun-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - closed by the OS at exit
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return code, Path(log.name).read_text()


def assert_same_steps(want: Path, got: Path, steps: list[int]) -> None:
    """The runs whose metrics files are `want` and `got` trained `steps` with the same loss, KL and gradient
    norm (within 1e-5, relative above 1): two layouts of one computation."""
    from molt_hpc.log import read_metrics

    a_steps, b_steps = read_metrics(want, "actor"), read_metrics(got, "actor")
    assert [r["step"] for r in b_steps] == steps
    for a, b in zip(a_steps, b_steps, strict=True):
        for key in ("loss", "kl", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])


def test_sampled_logprobs_match_a_teacher_forced_forward(tiny_model_dir: Path) -> None:
    import torch

    from molt_hpc.models import load_causal_lm

    groups = sample_groups(tiny_model_dir, 2, 3, seed=1)
    model = load_causal_lm(tiny_model_dir)
    for s in (s for g in groups for s in g.samples):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
        logp = logits.log_softmax(-1)
        start, end = s.action_ranges[0]
        want = [float(logp[t - 1, s.tokens[t]]) for t in range(start, end)]
        assert max(abs(a - b) for a, b in zip(want, s.action_logprobs, strict=True)) < 1e-4
    lengths = {s.num_action_tokens for g in groups for s in g.samples}
    assert len(lengths) > 1, "samples must differ in length"
