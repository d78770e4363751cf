"""The document generators on their own: variables found in command modules, units, the table region."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.bench.perf_doc import MARKER_BEGIN, MARKER_END, collect, render_table, replace_region
from pdserve.config_doc import command_flags, env_reads, split_env


def test_env_reads_finds_get_and_subscript(tmp_path: Path) -> None:
    (tmp_path / "one.py").write_text('import os\nA = os.environ.get("PDSERVE_A")\nB = os.environ["PDSERVE_B"]\n')
    (tmp_path / "two.py").write_text('import os\nA = os.environ.get("PDSERVE_A", "x")\nC = {}.get("NOT_ENV")\n')
    assert env_reads(tmp_path) == {"PDSERVE_A": ["one", "two"], "PDSERVE_B": ["one"]}


def test_flags_carry_default_unit_and_variable() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-lease-timeout", type=float, default=120.0, help="lease [env PDSERVE_KV_LEASE_TIMEOUT]")
    parser.add_argument("--mode", choices=["a", "b"], default="a")
    parser.add_argument("--flag", action="store_true")
    docs = {d.flags: d for d in command_flags("pdserve x", parser)}
    lease = docs["--kv-lease-timeout"]
    assert (lease.default, lease.unit, lease.env, lease.help) == ("`120.0`", "s", "PDSERVE_KV_LEASE_TIMEOUT", "lease")
    assert docs["--mode {a,b}"].default == "`a`"
    assert docs["--flag"].default == "off"
    assert split_env("no variable") == ("no variable", None)


def test_table_region_is_replaced_once_and_refused_without_markers(tmp_path: Path) -> None:
    text = f"intro\n{MARKER_BEGIN}\nold table\n{MARKER_END}\nrest\n"
    new = replace_region(text, "new table")
    assert new == f"intro\n{MARKER_BEGIN}\nnew table\n{MARKER_END}\nrest\n"
    assert replace_region(new, "new table") == new
    with pytest.raises(ValueError, match="markers"):
        replace_region("no markers here", "table")


def test_no_result_files_no_rows(tmp_path: Path) -> None:
    assert collect(tmp_path) == []
    assert render_table([], "x/") == ""


def _fake_serving_metrics(ttft: float) -> dict:
    return {"metrics": {"median_ttft_ms": ttft, "median_tpot_ms": 80.0, "output_throughput": 12.5}}


def test_serving_extractor_reads_the_structure_serving_cpu_writes(tmp_path: Path) -> None:
    """A FAKE result of the shape benchmarks/serving_cpu.py saves (its real one may not be committed yet)."""
    import json

    load = {"at": "x", "load1": 2.0, "load5": 2.0, "load15": 2.0, "cpus": 2}
    fake = {"date": "2026-11-29 12:00", "command": "benchmarks/serving_cpu.py --num-prompts 64 --input-len 200 "
            "--output-len 64 --rate 0.2 --relay-prompts 12", "load_at_start": load, "load_at_end": load,
            "deployments": {
                "disaggregated": {"poisson": _fake_serving_metrics(300.0), "max": _fake_serving_metrics(900.0),
                                  "relay": {"relay_delay_ms": {"p50": 0.4, "p99": 2.0},
                                            "relay_step_offset_ms": {"p50": 0.3, "p99": 1.5},
                                            "itl_direct_ms": {"p50": 70.0}}},
                "colocated": {"poisson": _fake_serving_metrics(350.0), "max": _fake_serving_metrics(1200.0)}}}
    (tmp_path / "serving_cpu.json").write_text(json.dumps(fake))
    [source] = collect(tmp_path)
    assert source.command.endswith("--relay-prompts 12 --out benchmarks/results/serving_cpu.json")
    assert [row.result for row in source.rows] == ["300 / 80 ms, 12.5 tokens/s", "900 / 80 ms, 12.5 tokens/s",
                                                   "0.30 / 1.50 ms per step, paired; 0.40 / 2.00 ms (upper bound)"]
    assert source.rows[0].baseline == "one colocated worker: 350 / 80 ms, 12.5 tokens/s"
