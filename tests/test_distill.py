"""On-policy distillation: the per-token advantage math (against a float64 hand computation), the teacher's
log-probs through the trace, the buffer and the trainer's batch (padded, packed, truncated), the teacher
process (token-checked `POST /logprobs`, exact log-probs) and the pre-flight of the teacher's tokenizer.

Real parts: a teacher process started by `jobs/engine.py --role teacher` on loopback, a teacher model built
offline from the tiny model's spec (4 layers, another seed), aiohttp, `molt-hpc run`'s pre-flight. Expected
log-probs come from plain transformers, one unpadded sequence at a time, softmax in float64.
"""

import asyncio
import json
import math
import shutil

import aiohttp
import pytest
import torch

from molt_hpc.actor.packing import packed
from molt_hpc.algorithm.distill import distill_advantages, reverse_kl, teacher_rate, topk_forward_kl
from molt_hpc.algorithm.experience import make_experience
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.config.model import TinyModelConfig
from molt_hpc.models import build_tiny
from molt_hpc.trajectory import Group, Trajectory
from tests.conftest import ROOT, molt
from tests.test_engine_procs import make_run, spawn, wait_registered

SEQS = [[2, 30, 31, 3, 4, 2, 40, 41, 42, 3], [2, 50, 3, 60], [2, 30, 31, 3, 4, 2, 41, 42, 43, 44, 3, 7, 8]]
SPANS = [[(6, 10)], [(3, 4)], [(6, 9), (11, 13)]]  # the third: two turns around feedback tokens 9-10


def build_teacher(out):
    """A teacher that is not the student: the tiny model's spec at 4 layers and another seed."""
    return build_tiny(out, TinyModelConfig(num_layers=4, init_seed=3))


def hf_logprobs(path, seqs, spans, temperature: float = 1.0) -> list[list[float]]:
    """log softmax(logits / T) in float64 of each span token, from a plain forward of each sequence alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for seq, rs in zip(seqs, spans, strict=True):
            logits = model(input_ids=torch.tensor([seq])).logits[0].double()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append([float(logp[t - 1, seq[t]]) for a, b in rs for t in range(a, b)])
    return out


def hf_top(path, seqs, spans, k: int, temperature: float = 1.0) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Per sequence, (ids, log-probs) of the `k` most likely tokens at each span token's position, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for seq, rs in zip(seqs, spans, strict=True):
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double() / temperature, dim=-1)
            tops = [logp[t - 1].topk(k) for a, b in rs for t in range(a, b)]
            out.append(([x.indices.tolist() for x in tops], [x.values.tolist() for x in tops]))
    return out


def check_top(answer, want) -> None:
    """The answer's `top_ids` and `top_logprobs` are `want`'s (`hf_top`), to 2e-5."""
    items = sorted(answer["data"], key=lambda d: d["index"])
    for item, (ids, values) in zip(items, want, strict=True):
        assert item["top_ids"] == ids and len(ids) == len(item["logprobs"])
        for got, w in zip(item["top_logprobs"], values, strict=True):
            assert got == pytest.approx(w, abs=2e-5)


# -- the math -----------------------------------------------------------------------------------------


def test_advantages_match_a_float64_hand_computation() -> None:
    """Two rows, one multi-turn (feedback tokens in between): teacher - student on action tokens only."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    teacher = torch.tensor([[9.0, 9.0, -0.25, -1.5, 9.0, 9.0, -2.0, 0.0], [0.0, -0.1, -3.0, -0.7, 0, 0, 0, 0]])
    student = torch.tensor([[7.0, 7.0, -0.75, -0.5, 7.0, 7.0, -2.5, 0.0], [0.0, -0.4, -1.0, -0.7, 0, 0, 0, 0]])
    env = torch.tensor([[0.0, 0.0, 0.8, 0.8, 0.0, 0.0, 0.8, 0.0], [0.0, -1.2, -1.2, -1.2, 0, 0, 0, 0]])
    t64, s64, e64 = teacher.double(), student.double(), env.double()
    replace = [[(t - s) if m else 0.0 for t, s, m in zip(tr, sr, mr, strict=True)]
               for tr, sr, mr in zip(t64.tolist(), s64.tolist(), mask.tolist(), strict=True)]  # fmt: skip
    add = [[(e + 0.3 * (t - s)) if m else 0.0 for t, s, e, m in zip(tr, sr, er, mr, strict=True)]
           for tr, sr, er, mr in zip(t64.tolist(), s64.tolist(), e64.tolist(), mask.tolist(), strict=True)]  # fmt: skip
    assert replace[0] == [0, 0, 0.5, -1.0, 0, 0, 0.5, 0] and replace[1] == pytest.approx([0, 0.3, -2.0, 0, 0, 0, 0, 0])
    got = distill_advantages(None, t64, s64, mask, "replace")
    assert got.dtype == torch.float64 and got.tolist() == replace
    got = distill_advantages(e64, t64, s64, mask, "add", weight=0.3)
    assert got.flatten().tolist() == pytest.approx([x for row in add for x in row], abs=1e-15)
    # whitened: (d - mean) / (std + eps) over the 6 action tokens, std with Bessel's correction
    d = [x for row, mr in zip(replace, mask.tolist(), strict=True) for x, m in zip(row, mr, strict=True) if m]
    mean = sum(d) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / 5)
    white = [[(x - mean) / (std + 1e-6) if m else 0.0 for x, m in zip(row, mr, strict=True)]
             for row, mr in zip(replace, mask.tolist(), strict=True)]  # fmt: skip
    got = distill_advantages(None, t64, s64, mask, "replace", whitened=True)
    assert got.flatten().tolist() == pytest.approx([x for row in white for x in row], abs=1e-12)
    got = distill_advantages(e64, t64, s64, mask, "add", weight=0.3, whitened=True)
    flat_white = [x for row in white for x in row]
    want = [(e + 0.3 * w) if m else 0.0
            for e, w, m in zip(e64.flatten().tolist(), flat_white, mask.flatten().tolist(), strict=True)]  # fmt: skip
    assert got.flatten().tolist() == pytest.approx(want, abs=1e-12)
    # the metric: mean over the 6 action tokens of student - teacher (the sampled reverse KL)
    want = sum(s - t for tr, sr, mr in zip(t64.tolist(), s64.tolist(), mask.tolist(), strict=True)
               for t, s, m in zip(tr, sr, mr, strict=True) if m) / 6  # fmt: skip
    assert reverse_kl(teacher, student, mask) == pytest.approx(want, abs=1e-7) and want == pytest.approx(1.7 / 6)
    assert reverse_kl(teacher, student, torch.zeros_like(mask)) == 0.0
    groups = [Group("a", "p", [], meta={"teacher_tokens": 30, "teacher_s": 0.5}), Group("b", "p", [], meta={})]
    assert teacher_rate(groups) == 60.0 and teacher_rate([groups[1]]) is None
    # the end-of-run line: first quarter -> last quarter of the steps' metric
    from molt_hpc.plot import distill_summary

    kls = [4.0, 3.0, 2.0, 2.0, 1.0, 0.5, 0.25, 0.75]
    steps = [{"step": i + 1, "distill/reverse_kl": kl} for i, kl in enumerate(kls)]
    assert distill_summary(steps) == "reverse KL to the teacher: first quarter 3.500 -> last quarter 0.500 nats/token"
    assert distill_summary([{"step": 1, "reward": 0.5}]) is None


def test_topk_forward_kl_matches_a_float64_hand_computation() -> None:
    """sum_j q_j (log q_j - log p_s(j)) with q the teacher's top-3 renormalised, on action tokens only; and
    its gradient in the student's log-probs is -q (the cross-entropy's)."""
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    teacher = torch.tensor([[[0.0, 0.0, 0.0], [-0.2, -2.0, -3.5], [-1.0, -1.1, -1.2]],
                            [[-0.05, -4.0, -6.0], [9.0, 9.0, 9.0], [0.0, 0.0, 0.0]]])  # fmt: skip
    student = torch.tensor([[[0.0, 0.0, 0.0], [-1.5, -0.5, -2.0], [-1.5, -1.6, -1.7]],
                            [[-3.0, -0.1, -5.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]]).double()  # fmt: skip

    def hand(t_row, s_row):
        z = sum(math.exp(x) for x in t_row)
        q = [math.exp(x) / z for x in t_row]
        return sum(qj * (math.log(qj) - sj) for qj, sj in zip(q, s_row, strict=True)), q

    want = [[hand(t, s)[0] if m else 0.0 for t, s, m in zip(tr, sr, mr, strict=True)]
            for tr, sr, mr in zip(teacher.tolist(), student.tolist(), mask.tolist(), strict=True)]  # fmt: skip
    student.requires_grad_(True)
    got = topk_forward_kl(teacher, student, mask)
    assert got.dtype == torch.float64 and got.flatten().tolist() == pytest.approx(
        [x for row in want for x in row], abs=1e-12
    )
    assert want[0][2] > 0 and want[0][1] > 0  # a student that matches the teacher's ranking still pays for the mass
    got.sum().backward()
    q = hand(teacher[0, 1].tolist(), student[0, 1].tolist())[1]
    assert student.grad[0, 1].tolist() == pytest.approx([-x for x in q], abs=1e-12)
    assert not student.grad[0, 0].any() and not student.grad[1, 1].any()


# -- the trace, the buffer, the batch -------------------------------------------------------------------


def taught(tokens, prompt_len, ranges, teacher) -> Trajectory:
    n = sum(b - a for a, b in ranges)
    return Trajectory(tokens, prompt_len, ranges, [-0.5] * n, [0] * n, teacher_logprobs=teacher, group_id="g")


def test_teacher_logprobs_travel_through_buffer_and_batch() -> None:
    multi = taught([10, 11, 12, 20, 21, 30, 31, 22, 23, 24], 3, [(3, 5), (7, 10)], [-0.25, -0.5, -1.0, -2.0, -4.0])
    short = taught([40, 41, 42], 1, [(1, 3)], [-0.125, -8.0])
    group = Group("g", "p", [multi, short])
    back = decode_group(encode_group(group))
    assert back.samples == group.samples  # float32-exact values: the codec's float32 loses nothing here
    with pytest.raises(AssertionError, match="one teacher log-prob per action token"):
        taught([1, 2, 3], 1, [(1, 3)], [-1.0])
    for pack in (False, True):
        exp = make_experience(back.samples, max_len=16, pack=pack)
        for n, traj in enumerate(back.samples):
            row, cols = torch.nonzero(exp.seq_index == n, as_tuple=True)
            values = exp.teacher_log_probs[row, cols]
            mask = exp.action_mask[row, cols]
            assert values[mask].tolist() == traj.teacher_logprobs and not values[~mask].any()
    # the packed micro-batch carries the field like every per-token one
    exp = make_experience(back.samples, max_len=16)
    mb = packed(exp, torch.tensor([0, 1]))
    assert mb.batch.teacher_log_probs[0].tolist() == [0, 0, 0, -0.25, -0.5, 0, 0, -1.0, -2.0, -4.0, 0, -0.125, -8.0]
    # truncation inside the second turn drops that turn's teacher values with it
    cut = make_experience([multi], max_len=8)
    assert cut.teacher_log_probs[0].tolist() == [0, 0, 0, -0.25, -0.5, 0, 0]
    plain = Trajectory([40, 41, 42], 1, [(1, 3)], [-0.5, -0.5], [0, 0])
    with pytest.raises(ValueError, match="1 of 2 trajectories lack the teacher's log-probs"):
        make_experience([multi, plain], max_len=16)
    with pytest.raises(ValueError, match="lack the teacher's log-probs"):
        encode_group(Group("h", "p", [multi, plain]))


# -- the teacher process ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_dir):
    model = build_teacher(tmp_path_factory.mktemp("teacher"))
    run = make_run(tmp_path_factory.mktemp("teaching"), "teaching", tiny_model_dir,
                   f"distill.teacher={json.dumps(str(model))}", "distill.max_batch=2")  # fmt: skip
    p = wait_registered(run, spawn(run, "teacher"), "teacher-0")
    yield run, p, model
    p.stop()


async def post(url: str, body, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/logprobs", json=body, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_teachers_own(teacher, temperature) -> None:
    """Batched two at a time and right-padded there, one unpadded sequence at a time here."""
    run, p, model = teacher
    body = {"input": SEQS, "ranges": SPANS, "temperature": temperature}
    status, answer = asyncio.run(post(p.url, body, run.token()))
    assert status == 200, answer
    got = [d["logprobs"] for d in sorted(answer["data"], key=lambda d: d["index"])]
    want = hf_logprobs(model, SEQS, SPANS, temperature)
    assert [len(g) for g in got] == [4, 1, 5] and answer["tokens"] == 10 and answer["seconds"] > 0
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=2e-5)
    assert all(math.isfinite(x) and x < 0 for g in got for x in g)


def test_top_tokens_are_the_teachers_own(teacher) -> None:
    """`top_k`: per scored token, the teacher's 5 most likely tokens at its position, at the temperature."""
    run, p, model = teacher
    status, answer = asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS, "temperature": 0.7, "top_k": 5},
                                      run.token()))  # fmt: skip
    assert status == 200, answer
    check_top(answer, hf_top(model, SEQS, SPANS, 5, 0.7))
    status, answer = asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS}, run.token()))
    assert all("top_ids" not in d for d in answer["data"])


def test_logprobs_refuse_without_the_token_and_bad_input(teacher) -> None:
    run, p, _ = teacher
    body = {"input": SEQS[:1], "ranges": SPANS[:1]}
    assert asyncio.run(post(p.url, body, None))[0] == 401
    assert asyncio.run(post(p.url, body, "wrong"))[0] == 401
    for bad, message in (
        ({"input": [[1, 2, 999]], "ranges": [[(1, 3)]]}, "outside the vocabulary"),
        ({"input": [[1, 2, 3]], "ranges": [[(0, 2)]]}, "outside 1..3"),
        ({"input": [[1, 2, 3]], "ranges": [[(2, 5)]]}, "outside 1..3"),
        ({"input": [[1, 2, 3]], "ranges": []}, "0 range lists for 1 sequences"),
        ({"input": [[5] * 4097], "ranges": [[(1, 2)]]}, "over the teacher's"),
        ({"input": [[1, 2, 3]], "ranges": [[(1, 2)]], "temperature": 0}, "temperature"),
        ({"input": [[1, 2, 3]], "ranges": [[(1, 2)]], "top_k": 21}, "top_k"),
    ):
        status, answer = asyncio.run(post(p.url, bad, run.token()))
        assert status == 400 and message in answer["error"], (bad, answer)


# -- pre-flight -----------------------------------------------------------------------------------------


def other_tokenizer(src, out, edit):
    shutil.copytree(src, out)
    data = json.loads((out / "tokenizer.json").read_text())
    edit(data)
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


def swap_ids(data) -> None:
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


def test_preflight_refuses_a_teacher_with_another_vocabulary(tmp_path, tiny_model_dir) -> None:
    bad = other_tokenizer(tiny_model_dir, tmp_path / "swapped", swap_ids)
    r = molt("run", "configs/tiny_cpu.toml", "--set", f"run.root={tmp_path}", "--set", f"distill.teacher={bad}",
             "--no-plan", timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: distill.teacher = '{bad}': its vocabulary is not"), lines
    assert "2 with other ids" in lines[0] and "name a teacher with the policy's tokenizer" in lines[0]
    assert not (tmp_path / "tiny-cpu").exists(), "nothing starts"


def test_preflight_refuses_a_teacher_that_cuts_prompts_into_other_ids(tmp_path, tiny_model_dir) -> None:
    """The same vocabulary, another pre-tokenizer: whole words, which the character vocabulary lacks."""
    from molt_hpc.config import load_config
    from molt_hpc.launch.preflight import PreflightError, preflight

    def whole_words(data) -> None:
        data["pre_tokenizer"] = {"type": "WhitespaceSplit"}

    bad = other_tokenizer(tiny_model_dir, tmp_path / "words", whole_words)

    def config(teacher):
        return load_config(ROOT / "configs" / "tiny_cpu.toml", [f"run.root={tmp_path}", f"distill.teacher={teacher}"])

    with pytest.raises(PreflightError, match=r"renders prompt 0 of the run into other ids \(they part at token"):
        preflight(config(bad), cwd=ROOT, warn=lambda _: None)
    assert preflight(config(tiny_model_dir), cwd=ROOT).distill.teacher == str(tiny_model_dir)


def test_preflight_refuses_a_chat_mode_agent_and_a_reward_model_teacher(tmp_path, tiny_model_dir) -> None:
    from molt_hpc.config import load_config
    from molt_hpc.launch.preflight import PreflightError, preflight
    from molt_hpc.models.reward import load_reward_model

    base = [f"run.root={tmp_path}", f"distill.teacher={tiny_model_dir}"]
    chat = load_config(ROOT / "configs" / "tiny_cpu.toml", [*base, "rollout.agent=envs/reverse_chat.py"])
    with pytest.raises(PreflightError, match=r"a chat-mode agent \(rollout.agent = .*reverse_chat.py'\) does not"):
        preflight(chat, cwd=ROOT)
    load_reward_model(tiny_model_dir).save_pretrained(tmp_path / "rm")
    rm = load_config(ROOT / "configs" / "tiny_cpu.toml", [f"run.root={tmp_path}", f"distill.teacher={tmp_path / 'rm'}"])
    with pytest.raises(PreflightError, match=r"is a reward model .* not a causal LM"):
        preflight(rm, cwd=ROOT)


def test_teachers_run_on_the_pools_first_node_after_the_engines_and_scorers(tmp_path, monkeypatch) -> None:
    """GPU placement: engine 0 takes GPU 0, the scorer the next one, the two teachers the two after."""
    from molt_hpc.config import load_config
    from molt_hpc.launch.local import split_gpus
    from molt_hpc.launch.pool import pool_children
    from molt_hpc.rundir import RunDir

    cfg = load_config(None, ["actor.device=cuda", "engines.device=cuda", "reward_model.path=rm",
                             "reward_model.device=cuda", "distill.teacher=t", "distill.count=2",
                             "distill.device=cuda"])  # fmt: skip
    assert split_gpus(cfg, [str(i) for i in range(6)]) == (["0"], ["1", "2", "3", "4"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2,3,4")
    run = RunDir(tmp_path)
    engines = pool_children(cfg, run, 0)[0]
    gpus = {c.name: c.env["CUDA_VISIBLE_DEVICES"] for c in engines}
    assert gpus == {"engine 0": "1", "scorer 0": "2", "teacher 0": "3", "teacher 1": "4"}
    teacher = next(c for c in engines if c.name == "teacher 1")
    assert teacher.cmd[-4:] == ["--role", "teacher", "--index", "1"] and teacher.log.name == "teacher-1.log"
    assert [c.name for c in pool_children(cfg, run, 1)[0]] == ["engine 1"]  # only the first node has teachers
    cpu = load_config(None, ["distill.teacher=t", "distill.device=cpu"])
    assert next(c for c in pool_children(cpu, run, 0)[0] if c.name == "teacher 0").env["CUDA_VISIBLE_DEVICES"] == ""
