"""The vLLM teacher (`distill.kind = "vllm"`): its `vllm serve` command, the config's refusals, the reading
of vLLM's prompt log-probs, and the teacher process on a CPU around a stand-in `vllm serve`.

The stand-in (`tests/vllm_teacher_standin.py`) is a real process that answers vLLM's completions route with
prompt log-probs from a real forward of the teacher model; the teacher process starts it exactly as it
starts vLLM (`python -m vllm.entrypoints.openai.api_server ...`, the token in its environment). Expected
log-probs come from plain transformers, one sequence at a time, softmax in float64 (`hf_logprobs`).
"""

import asyncio
import json
import os
import signal

import pytest

from molt_hpc.config import ConfigError, load_config
from molt_hpc.scorer.teacher_vllm import completion_body, span_values, vllm_teacher_command
from tests.test_distill import SEQS, SPANS, build_teacher, check_top, hf_logprobs, hf_top, post
from tests.test_engine_procs import make_run, spawn, wait_registered
from tests.vllm_teacher_standin import standin_site

VLLM = ["distill.teacher=t", "distill.kind=vllm"]


def test_vllm_teacher_command_follows_the_config() -> None:
    cfg = load_config(None, [*VLLM, "distill.dtype=bfloat16", "distill.gpu_memory_utilization=0.35",
                             "engines.max_model_len=2048", "distill.extra_args=['--enforce-eager']"])  # fmt: skip
    cmd = vllm_teacher_command(cfg, "/models/t", 4321, index=1)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/t"]
    flags = dict(zip(cmd[5:-1:2], cmd[6:-1:2], strict=True))
    assert flags == {"--host": "127.0.0.1", "--port": "4321", "--served-model-name": "teacher", "--dtype": "bfloat16",
                     "--max-model-len": "2049", "--generation-config": "vllm", "--gpu-memory-utilization": "0.35",
                     "--seed": str(cfg.run.seed * 1000 + 701)}  # fmt: skip
    assert cmd[-1] == "--enforce-eager"
    assert completion_body([[1, 2]]) == {"model": "teacher", "prompt": [[1, 2]], "max_tokens": 1,
                                         "temperature": 1.0, "prompt_logprobs": 0}  # fmt: skip
    assert completion_body([[1, 2]], top_k=5)["prompt_logprobs"] == 5


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["distill.device=cpu"], "distill.kind = 'vllm' runs on GPUs but distill.device = 'cpu'"),
        (["rollout.temperature=0.8"], "set rollout.temperature = 1, or use distill.kind = 'builtin'"),
    ],
)
def test_config_refuses_what_a_vllm_teacher_cannot_do(sets, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [*VLLM, *sets])
    load_config(None, ["distill.teacher=t", *sets])  # the builtin kind does both


def entry(lp: float, rank: int) -> dict:
    return {"logprob": lp, "rank": rank, "decoded_token": "x"}


def test_span_values_read_vllms_prompt_logprobs() -> None:
    """vLLM's answer (choices in any order, string token-id keys, extra top entries) to the spans' values."""
    seqs, spans = [[5, 6, 7, 8], [9, 10]], [[(1, 2), (3, 4)], [(1, 2)]]
    answer = {"choices": [
        {"index": 1, "prompt_logprobs": [None, {"10": entry(-0.5, 1)}]},
        {"index": 0, "prompt_logprobs": [None, {"3": entry(-0.1, 1), "6": entry(-2.25, 4)}, {"7": entry(-9.0, 7)},
                                         {"8": entry(-1.0, 2), "1": entry(-0.75, 1)}]},
    ]}  # fmt: skip
    assert span_values(answer, seqs, spans) == [{"logprobs": [-2.25, -1.0]}, {"logprobs": [-0.5]}]
    missing = json.loads(json.dumps(answer))
    del missing["choices"][1]["prompt_logprobs"][3]["8"]
    with pytest.raises(ValueError, match=r"prompt_logprobs\[3\] has no log-prob of the actual token 8"):
        span_values(missing, seqs, spans)
    with pytest.raises(ValueError, match="1 choices for 2 prompts"):
        span_values({"choices": answer["choices"][:1]}, seqs, spans)
    short = {"choices": [answer["choices"][0], {"index": 0, "prompt_logprobs": [None, {}]}]}
    with pytest.raises(ValueError, match="not a list of 4 entries led by None"):
        span_values(short, seqs, spans)


def test_span_values_read_the_top_tokens() -> None:
    """`prompt_logprobs: k`: each position's entries ranked 1..k, most likely first; the actual token's own
    entry may lie outside them (rank 4 here) or among them (its key appears once)."""
    seqs, spans = [[5, 6, 7]], [[(1, 3)]]
    plp = [None, {"6": entry(-3.0, 4), "2": entry(-0.5, 1), "9": entry(-1.5, 2)},
           {"4": entry(-1.25, 2), "7": entry(-0.25, 1)}]  # fmt: skip
    got = span_values({"choices": [{"index": 0, "prompt_logprobs": plp}]}, seqs, spans, top_k=2)
    assert got == [
        {"logprobs": [-3.0, -0.25], "top_ids": [[2, 9], [7, 4]], "top_logprobs": [[-0.5, -1.5], [-0.25, -1.25]]}
    ]
    del plp[2]["4"]
    with pytest.raises(ValueError, match=r"prompt_logprobs\[2\] does not rank its top 2 tokens 1..2"):
        span_values({"choices": [{"index": 0, "prompt_logprobs": plp}]}, seqs, spans, top_k=2)


def standins(where) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(where.glob("standin-*.json"), key=os.path.getmtime)]


@pytest.fixture(scope="module")
def vllm_teacher(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("vllm-teacher")
    model, site, records = build_teacher(root / "teacher"), standin_site(root / "site"), root / "records"
    records.mkdir()
    run = make_run(root, "teaching", tiny_model_dir, f"distill.teacher={json.dumps(str(model))}",
                   "distill.kind=vllm")  # fmt: skip
    env = {"PYTHONPATH": str(site), "VLLM_STANDIN_DIR": str(records), "CUDA_VISIBLE_DEVICES": ""}
    p = wait_registered(run, spawn(run, "teacher", env=env), "teacher-0")
    yield run, p, model, records
    p.stop()


def test_the_vllm_teacher_answers_the_teachers_own_logprobs(vllm_teacher) -> None:
    run, p, model, records = vllm_teacher
    (started,) = standins(records)
    assert started["argv"][:2] == ["--model", str(model)] and run.token() not in " ".join(started["argv"])
    assert json.loads((run.rendezvous / "teacher-0.json").read_text())["kind"] == "vllm"
    status, answer = asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS}, run.token()))
    assert status == 200, answer
    got = [d["logprobs"] for d in sorted(answer["data"], key=lambda d: d["index"])]
    assert [len(g) for g in got] == [4, 1, 5] and answer["tokens"] == 10 and answer["seconds"] > 0
    for g, w in zip(got, hf_logprobs(model, SEQS, SPANS), strict=True):
        assert g == pytest.approx(w, abs=1e-5)


def test_the_vllm_teacher_answers_top_tokens(vllm_teacher) -> None:
    """`top_k` goes to vLLM as `prompt_logprobs`; its entries ranked 1..k come back, most likely first."""
    run, p, model, _ = vllm_teacher
    status, answer = asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS, "top_k": 5}, run.token()))
    assert status == 200, answer
    check_top(answer, hf_top(model, SEQS, SPANS, 5))


def test_the_vllm_teacher_refuses_without_the_token_and_bad_input(vllm_teacher) -> None:
    run, p, _, _ = vllm_teacher
    body = {"input": SEQS[:1], "ranges": SPANS[:1]}
    assert asyncio.run(post(p.url, body, None))[0] == 401
    for bad, message in (
        ({**body, "temperature": 0.7}, "a vLLM teacher scores at temperature 1 only"),
        ({"input": [[1, 2, 999]], "ranges": [[(1, 3)]]}, "outside the vocabulary"),
        ({"input": [[5] * 4097], "ranges": [[(1, 2)]]}, "over the teacher's"),
    ):
        status, answer = asyncio.run(post(p.url, bad, run.token()))
        assert status == 400 and message in answer["error"], (bad, answer)


def test_vllm_dying_ends_the_teacher_process(vllm_teacher) -> None:
    """Last in this module: the pool restarts a teacher that exits 1 (`test_distill_vllm_run.py`)."""
    run, p, _, records = vllm_teacher
    os.kill(standins(records)[-1]["pid"], signal.SIGKILL)
    assert p.proc.wait(timeout=30) == 1
    assert "vLLM exited with -9 while serving" in p.log.read_text()
    assert not (run.rendezvous / "teacher-0.json").exists()
