"""What `pdserve plan` prints after its table: how its choice is made (the attainment gate) and the commands
that deploy it, with the batching limits the simulation assumed, so that what runs is what was simulated.

    pdserve serve --num-prefill 2 --num-decode 3 --max-num-seqs 64 --max-num-batched-tokens 2048 --num-blocks 2048
    pdserve compose --prefill-gpus 0,1 --decode-gpus 2,3,4 --output compose.gpus.yaml     (a GPU profile)
"""

from __future__ import annotations

from pdserve.bench.metrics import SLOs
from pdserve.planner.plan import Candidate
from pdserve.planner.simulator import ClusterSpec

_SLO_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E latency"}


def gate_explanation(target: float, slos: SLOs) -> str:
    within = ", ".join(f"{_SLO_NAMES.get(k, k)} <= {v:g} ms" for k, v in slos.to_dict().items())
    return (f"How the choice is made: a split's attainment is the share of its simulated requests within every "
            f"SLO ({within}); a split qualifies when its attainment reaches {target:.0%} "
            f"(--target-attainment). The smallest qualifying cluster is recommended: at a given arrival rate "
            f"goodput cannot exceed the rate, so more workers than that only divide it (the most goodput per "
            f"worker). `refused` counts requests no decode worker had KV room for (the router would answer 503).")


def serve_command(choice: Candidate, cluster: ClusterSpec, model_args: list[str]) -> list[str]:
    return ["pdserve", "serve", *model_args, "--num-prefill", str(choice.num_prefill), "--num-decode",
            str(choice.num_decode), "--max-num-seqs", str(cluster.max_num_seqs), "--max-num-batched-tokens",
            str(cluster.max_num_batched_tokens), "--num-blocks", str(cluster.num_blocks)]


def compose_command(choice: Candidate, first_gpu: int = 0) -> list[str]:
    """One GPU per worker: prefill workers on the first GPUs, decode workers on the next."""
    prefill = range(first_gpu, first_gpu + choice.num_prefill)
    decode = range(prefill.stop, prefill.stop + choice.num_decode)
    return ["pdserve", "compose", "--prefill-gpus", ",".join(map(str, prefill)), "--decode-gpus",
            ",".join(map(str, decode)), "--output", "compose.gpus.yaml"]


def model_args(profile_model: str, default_preset: str) -> tuple[list[str], str | None]:
    """The serve arguments naming the model, and a note when the profile cannot name it: a profile knows the
    shapes it measured (a preset or a config directory's name), not where the weights are."""
    if profile_model == default_preset:
        return [], None
    return ["MODEL"], (f"MODEL: the model whose shapes were profiled ({profile_model}): its Hugging Face repo id, "
                       f"directory or .gguf file")


def deploy_lines(choice: Candidate, cluster: ClusterSpec, profile_model: str, profile_device: str,
                 default_preset: str) -> list[str]:
    args, note = model_args(profile_model, default_preset)
    lines = ["Deploy it (the limits the simulation assumed; --num-blocks is per decode worker):",
             "  " + " ".join(serve_command(choice, cluster, args))]
    if profile_device.startswith("cuda"):
        lines += ["  or with Docker Compose, one GPU per worker:",
                  "  " + " ".join(compose_command(choice)) + " && docker compose -f compose.gpus.yaml up -d"]
    if note:
        lines.append(f"  {note}")
    return lines
