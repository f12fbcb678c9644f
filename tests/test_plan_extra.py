"""`molt-hpc plan --extra-engines N`: what an extra engine pool adds, from the plan's own numbers and the
closed forms (bf16 weights are 2 bytes a parameter; a refit sends them over plan.network_gb_per_s)."""

import re

from click.testing import CliRunner

from molt_hpc.cli import main
from molt_hpc.config import load_config
from molt_hpc.plan import plan_config
from molt_hpc.plan.arch import arch_of
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs" / "8b_dense.toml")


def test_an_extra_pool_reports_its_memory_refit_and_capacity() -> None:
    cfg = load_config(CONFIG, [])
    plan, _ = plan_config(cfg, local=False)
    arch = arch_of(cfg.model)
    out = CliRunner().invoke(main, ["plan", CONFIG, "--extra-engines", "3"])
    assert out.exit_code == (0 if plan.runnable else 1), out.output
    text = out.output[out.output.index("extra pool of 3 engine(s)") :]
    wire = 2 * arch.params  # bf16 on the wire
    assert abs(plan.refit.bytes - wire) < 1, (plan.refit.bytes, wire)
    ms = float(re.search(r"≈ ([\d,.]+) ms", text).group(1).replace(",", ""))
    assert abs(ms - wire / (cfg.plan.network_gb_per_s * 1e9) * 1e3) < 0.06
    engines = plan.engines.engines
    assert f"{engines} -> {engines + 3} engines: at most {(engines + 3) / engines:,.2f}x" in text
    assert f"{plan.engines.kv_tokens:,} tokens" in text


def test_without_the_flag_the_report_has_no_extra_pool() -> None:
    out = CliRunner().invoke(main, ["plan", CONFIG])
    assert "extra pool" not in out.output
