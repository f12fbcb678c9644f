"""Run-record summaries (`molt_hpc.records`) against hand-made records."""

import json

from molt_hpc.records import rollout_rate


def test_the_rollout_rate_leaves_out_the_wind_down_after_the_last_step():
    windows = [
        {"time": 10.0, "window_s": 2.0, "groups_per_s": 4.0, "tokens_per_s": 100.0},  # 8 groups, 200 tokens
        {"time": 13.0, "window_s": 3.0, "groups_per_s": 2.0, "tokens_per_s": 50.0},  # 6 groups, 150 tokens
        {"time": 40.0, "window_s": 27.0, "groups_per_s": 0.1, "tokens_per_s": 1.0},  # after the last step
    ]
    groups, tokens, n = rollout_rate(windows, until=13.0)
    assert n == 2 and abs(groups - 14 / 5) < 1e-12 and abs(tokens - 350 / 5) < 1e-12
    assert rollout_rate(windows, until=13.0, windows=1)[:2] == (2.0, 50.0)
    assert rollout_rate(windows, until=None)[2] == 3  # a live run: every window so far
    assert rollout_rate([], until=1.0) is None


def test_the_metrics_tail_returns_whole_new_lines_once(tmp_path) -> None:
    from molt_hpc.records import MetricsTail

    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new() == [], "no file yet"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"ste')
    assert tail.new() == [{"step": 1}, {"step": 2}], "a line still being written waits"
    with open(path, "ab") as f:
        f.write(b'p": 3}\nnot json\n' + json.dumps({"step": 4}).encode() + b"\n")
    assert tail.new() == [{"step": 3}, {"step": 4}], "the rest of the torn line, the bad line skipped"
    assert tail.new() == []
    assert MetricsTail(path, offset=path.stat().st_size).new() == [], "a tail from the end sees nothing old"
