"""What a waiting user sees: the launcher's activity line while no step comes."""

from pathlib import Path

from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import create_run_dir


def test_activity_names_engines_starting_and_a_checkpoint_being_written(tmp_path: Path) -> None:
    from molt_hpc.checkpoint import TMP_PREFIX
    from molt_hpc.launch.progress import activity

    run = create_run_dir(tmp_path, "run", to_toml(load_config(None)))
    assert activity(run, engines=2) == (
        "starting: 0/2 engines up (a vLLM engine loads and compiles for minutes; see logs/)"
    )
    (run.rendezvous / "engine-0.json").write_text("{}")
    (run.rendezvous / "engine-1.json").write_text("{}")
    assert activity(run, engines=2) is None
    tmp = run.checkpoints / f"{TMP_PREFIX}step_000050"
    (tmp / "policy").mkdir(parents=True)
    (tmp / "policy" / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    assert activity(run, engines=2) == "writing checkpoint step_000050: 0.003 GB so far"
