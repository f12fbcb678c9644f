"""The vLLM front stamps versions on vLLM's answer bytes without re-encoding them when no refit finished
during the request, and decodes and stamps per token when one did; readers see the same result."""

import json

from molt_hpc.engine.client import parse_generate_response
from molt_hpc.engine.vllm.front import stamp_versions, stamped_body

ANSWER = {
    "request_id": "r",
    "choices": [{"index": 0, "token_ids": [4, 5, 6], "finish_reason": "length",
                 "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5 * t} for t in (4, 5, 6)]}}],
}  # fmt: skip


def test_unchanged_version_keeps_vllms_bytes() -> None:
    raw = json.dumps(ANSWER).encode()
    body = stamped_body(raw, start=3, now=3)
    assert body.endswith(raw[1:]), "vLLM's bytes follow the stamp untouched"
    got = parse_generate_response(json.loads(body))
    assert got.weight_version == 3 and got.weight_versions == [3, 3, 3]
    assert got.token_ids == [4, 5, 6] and got.logprobs == [-2.0, -2.5, -3.0]


def test_a_straddled_refit_stamps_the_start_version_per_token() -> None:
    raw = json.dumps(ANSWER).encode()
    data = json.loads(stamped_body(raw, start=2, now=3))
    assert data == stamp_versions(json.loads(raw), 2, 3)
    got = parse_generate_response(data)
    assert got.weight_version == 3 and got.weight_versions == [2, 2, 2]


def test_an_empty_object_is_still_valid_json() -> None:
    assert json.loads(stamped_body(b" {} ", start=1, now=1)) == {"weight_version": 1}
