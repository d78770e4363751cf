from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.bench.datasets import LengthSpec
from pdserve.bench.metrics import SLOs
from pdserve.cli import main
from pdserve.planner.plan import Planner, capacity_estimates, format_plan
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import ClusterSpec
from pdserve.planner.workload import WorkloadSpec

SLO = SLOs(ttft_ms=300, tpot_ms=30)
REPO_PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan_validation_profile_cpu.json"


def _spec(rate: float) -> WorkloadSpec:
    return WorkloadSpec(rate, 1500, LengthSpec(1024, 0.5), LengthSpec(128, 0.5), seed=2)


def test_capacity_estimates_follow_the_profile(gpu_like_profile: Profile) -> None:
    cap_p, cap_d = capacity_estimates(gpu_like_profile, ClusterSpec(1, 1), _spec(10.0), SLO)
    assert cap_p == pytest.approx(2 / gpu_like_profile.prefill_time([1024, 1024]))
    assert 10 < cap_d < 64 / (0.006 * 127)  # at most max_num_seqs in flight, each 127 steps


def test_plan_finds_the_smallest_cluster_within_slos(gpu_like_profile: Profile) -> None:
    cluster = ClusterSpec(1, 1, num_blocks=8000)
    planner = Planner(gpu_like_profile, cluster, _spec(60.0), SLO, target_attainment=0.9)
    result = planner.search()
    best = result.recommended
    assert best is not None and best.attainment >= 0.9
    smaller = [c for c in result.candidates if c.num_workers < best.num_workers]
    assert smaller and all(c.attainment < 0.9 for c in smaller)
    same = [c for c in result.candidates if c.num_workers == best.num_workers]
    assert best.goodput_per_worker == max(c.goodput_per_worker for c in same if c.attainment >= 0.9)
    table = format_plan(result, SLO)
    assert "recommended" in table and f"{best.num_prefill} prefill + {best.num_decode} decode" in table


def test_plan_reports_when_nothing_fits(gpu_like_profile: Profile) -> None:
    planner = Planner(gpu_like_profile, ClusterSpec(1, 1), _spec(60.0), SLOs(ttft_ms=1), max_workers=4)
    result = planner.search()
    assert result.recommended is None and "no split" in format_plan(result, SLOs(ttft_ms=1))
    with pytest.raises(ValueError, match="SLO"):
        Planner(gpu_like_profile, ClusterSpec(1, 1), _spec(1.0), SLOs())


def test_plan_command(gpu_like_profile: Profile, tmp_path: Path, capsys) -> None:
    prof = gpu_like_profile.save(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    rc = main(["plan", "--profile", str(prof), "--request-rate", "20", "--num-requests", "800", "--input-len", "512",
               "--output-len", "64", "--goodput", "ttft:300", "tpot:30", "--num-blocks", "4000", "--output", str(out)])
    assert rc == 0
    assert "recommended:" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["recommended"]["attainment"] >= 0.9 and saved["slos_ms"] == {"ttft": 300.0, "tpot": 30.0}
    rc = main(["plan", "--profile", str(prof), "--request-rate", "5", "--num-requests", "200", "--num-prefill", "1",
               "--num-decode", "2"])
    assert rc == 0 and "   1    2     3" in capsys.readouterr().out


def test_plan_draws_lengths_from_a_bench_result(gpu_like_profile: Profile, tmp_path: Path, capsys) -> None:
    from pdserve.planner.workload import make_workload

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"input_lens": [100, 900, 300], "output_lens": [10, 50, 0]}))
    spec = WorkloadSpec.from_bench_result(bench, 5.0, 400)
    w = make_workload(spec)
    assert set(zip(w.input_len.tolist(), w.output_len.tolist())) == {(100, 10), (900, 50)}
    assert spec.input_len.mean == 500 and spec.output_len.mean == 30
    prof = gpu_like_profile.save(tmp_path / "profile.json")
    rc = main(["plan", "--profile", str(prof), "--request-rate", "5", "--num-requests", "300", "--lengths-from",
               str(bench), "--goodput", "ttft:500", "tpot:50"])
    assert rc == 0 and "recommended:" in capsys.readouterr().out


def test_plan_explains_its_gate_and_prints_the_commands_that_deploy_its_choice(gpu_like_profile: Profile,
                                                                                 tmp_path: Path, capsys) -> None:
    from pdserve.cli import build_parser

    prof = gpu_like_profile.save(tmp_path / "gpu.json")
    rc = main(["plan", "--profile", str(prof), "--request-rate", "20", "--num-requests", "400", "--input-len", "512",
               "--output-len", "64", "--goodput", "ttft:500", "tpot:40", "--max-num-seqs", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "a split qualifies when its attainment reaches 90% (--target-attainment)" in out
    assert "TTFT <= 500 ms, TPOT <= 40 ms" in out
    serve = next(line.strip() for line in out.splitlines() if line.strip().startswith("pdserve serve"))
    compose = next(line.strip() for line in out.splitlines() if line.strip().startswith("pdserve compose"))
    p, d = (int(x) for x in re.search(r"recommended: (\d+) prefill \+ (\d+) decode", out).groups())
    args = build_parser().parse_args(serve.replace("MODEL", "org/model").split()[1:])
    assert (args.num_prefill, args.num_decode, args.max_num_seqs, args.model) == (p, d, 32, "org/model")
    gpus = build_parser().parse_args(compose.split(" && ")[0].split()[1:])
    assert len(gpus.prefill_gpus.split(",")) == p and len(gpus.decode_gpus.split(",")) == d
    assert "MODEL: the model whose shapes were profiled (synthetic-8b)" in out


def test_a_cpu_profile_of_the_default_model_needs_no_model_argument(tmp_path: Path, capsys) -> None:
    main(["plan", "--profile", str(REPO_PROFILE), "--request-rate", "1", "--input-len", "512", "--output-len", "64",
          "--goodput", "ttft:2000", "tpot:100", "--max-workers", "4", "--num-requests", "300"])
    out = capsys.readouterr().out
    serve = next(line.strip() for line in out.splitlines() if line.strip().startswith("pdserve serve"))
    assert serve.startswith("pdserve serve --num-prefill") and "pdserve compose" not in out
