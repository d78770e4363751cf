"""Pool sizes for deploy/k8s: `pdserve plan ... --kustomize-replicas FILE` writes the plan's P and D counts as a
kustomize patch, which an overlay lists under `patches:` (overlays/cpu/replicas.yaml, overlays/gpu/replicas.yaml).

    Deployment pdserve-prefill / pdserve-decode          spec.replicas = the plan's counts
    HorizontalPodAutoscaler pdserve-prefill / -decode    minReplicas = the counts, maxReplicas = ceil(count x F)
                                                         (only with --hpa-max-factor F: an overlay without the
                                                         autoscaling component has no HPA to patch)

The plan sizes the pools for the request rate it was given; the autoscalers then follow the load from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEPLOYMENTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}  # deploy/k8s/base


@dataclass(frozen=True)
class ReplicaPlan:
    num_prefill: int
    num_decode: int
    hpa_max_factor: float | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"a plan needs >= 1 worker per pool, got {self.num_prefill} P and {self.num_decode} D")
        if self.hpa_max_factor is not None and self.hpa_max_factor < 1:
            raise ValueError(f"--hpa-max-factor must be >= 1 (max >= min replicas), got {self.hpa_max_factor}")

    def counts(self) -> dict[str, int]:
        return {"prefill": self.num_prefill, "decode": self.num_decode}

    def max_replicas(self, count: int) -> int:
        assert self.hpa_max_factor is not None
        return max(count, math.ceil(count * self.hpa_max_factor))


def kustomize_patch(plan: ReplicaPlan, comment: str) -> str:
    """The patch file's text: `comment` (the command that wrote it) as a header, then one document per object."""
    docs = [f"apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {DEPLOYMENTS[pool]}\n"
            f"spec:\n  replicas: {count}\n" for pool, count in plan.counts().items()]
    if plan.hpa_max_factor is not None:
        docs += [f"apiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\nmetadata:\n  name: {DEPLOYMENTS[pool]}\n"
                 f"spec:\n  minReplicas: {count}\n  maxReplicas: {plan.max_replicas(count)}\n"
                 for pool, count in plan.counts().items()]
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + "---\n".join(docs)
