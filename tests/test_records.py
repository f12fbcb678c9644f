"""Run-record summaries (`molt_hpc.records`) against hand-made records."""

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
