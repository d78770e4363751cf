"""`pdserve plan --kustomize-replicas` (planner/replicas.py): the recommended pool sizes as a kustomize
patch that an overlay of deploy/k8s renders with: the Deployments' replicas and the autoscalers' bounds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdserve.cli import main
from pdserve.planner.profile import Profile
from pdserve.planner.replicas import ReplicaPlan, kustomize_patch
from tests.deploy.kustomize import K8S, kustomize_command, render


def test_the_patch_names_the_base_objects() -> None:
    docs = list(yaml.safe_load_all(kustomize_patch(ReplicaPlan(3, 2, hpa_max_factor=1.5), "made here\nby a test")))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Deployment", "pdserve-prefill"), ("Deployment", "pdserve-decode"),
        ("HorizontalPodAutoscaler", "pdserve-prefill"), ("HorizontalPodAutoscaler", "pdserve-decode")]
    assert [d["spec"] for d in docs] == [{"replicas": 3}, {"replicas": 2}, {"minReplicas": 3, "maxReplicas": 5},
                                         {"minReplicas": 2, "maxReplicas": 3}]
    assert len(list(yaml.safe_load_all(kustomize_patch(ReplicaPlan(1, 1), "no autoscalers")))) == 2
    with pytest.raises(ValueError, match="max >= min"):
        ReplicaPlan(1, 1, hpa_max_factor=0.5)


@pytest.mark.skipif(kustomize_command() is None, reason="kubectl (or kustomize) is not installed")
def test_plan_writes_the_replicas_an_overlay_renders(gpu_like_profile: Profile, tmp_path: Path, capsys) -> None:
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    profile = gpu_like_profile.save(tmp_path / "profile.json")
    target = tree / "overlays" / "gpu" / "replicas.yaml"
    rc = main(["plan", "--profile", str(profile), "--request-rate", "20", "--num-requests", "800", "--input-len",
               "512", "--output-len", "64", "--goodput", "ttft:300", "tpot:30", "--num-blocks", "4000",
               "--kustomize-replicas", str(target), "--hpa-max-factor", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and f"wrote {target}" in out
    planned = out.split("recommended: ")[1].split(" decode")[0]  # "P prefill + D"
    num_prefill, num_decode = int(planned.split()[0]), int(planned.split()[-1])
    rendered = render(tree / "overlays" / "gpu")
    for name, count in (("pdserve-prefill", num_prefill), ("pdserve-decode", num_decode)):
        assert rendered.deployment(name)["spec"]["replicas"] == count
        hpa = rendered.get("HorizontalPodAutoscaler", name)["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (count, 2 * count)
        assert hpa["metrics"]  # the patch leaves the autoscaler's metrics alone
