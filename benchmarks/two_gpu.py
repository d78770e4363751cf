"""Two GPUs of one host: one request's KV from P (GPU 0) to D (GPU 1) by cuda_ipc and by nccl, against a plain
peer copy of the same bytes (torch `copy_` between the devices). JSON to benchmarks/results/.

    python benchmarks/two_gpu.py [--tokens 4096] [--preset llama3-8b] [--repeat 5] \
        [--backends copy cuda_ipc nccl] [--devices cuda:0 cuda:1] [--out benchmarks/results/two_gpu_h200.json]
    NCCL_P2P_DISABLE=1 python benchmarks/two_gpu.py --backends nccl --out benchmarks/results/two_gpu_nccl_no_p2p.json
                                      (what nccl gives on GPUs without peer access: through host memory)
    python benchmarks/two_gpu.py --devices cpu cpu --preset smollm2-135m --tokens 64 --backends nccl
                                      (the plumbing on a machine without GPUs: nccl's group is gloo there)

D is this process (the receiver, on the second device, pool of 2 x the request's blocks: transfers alternate
halves); P is a child process (`two_gpu.py _prefill SPEC`) on the first device that pushes every layer with
`send_layer` and returns from `finish` (cuda_ipc: after its copies' event; nccl: after every send completed),
`repeat` times after 2 warm-ups (handshake, group join, Triton compile). Time per transfer: P's first send ->
finish returned (wall clock, launches paced by Python). D checks that the last transfer's blocks hold P's values.
The copy baseline: one copy_ of all the bytes, and one per layer, GPU 0 -> GPU 1, both devices synchronized.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pdserve.engine.presets import get_preset
from pdserve.kv_transfer.registry import get_backend
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import DTYPES, dtype_name

BLOCK_SIZE = 16
SECRET = "two-gpu-benchmark"
BACKENDS = ("copy", "cuda_ipc", "nccl")
WARMUP = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of KV in the request (whole blocks)")
    parser.add_argument("--preset", default="llama3-8b", help="model shape (engine/presets.py)")
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per backend (after 2 warm-ups)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:1"], metavar=("P", "D"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/two_gpu_h200.json"))
    return parser


def check_args(args: argparse.Namespace) -> None:
    if args.tokens <= 0 or args.tokens % BLOCK_SIZE:
        raise SystemExit(f"--tokens must be a positive multiple of {BLOCK_SIZE}, got {args.tokens}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    on_cpu = [d for d in args.devices if not d.startswith("cuda")]
    gpu_only = [b for b in args.backends if b != "nccl"]
    if on_cpu and gpu_only:
        raise SystemExit(f"{gpu_only} need two CUDA devices, --devices is {args.devices}; on CPUs only nccl (gloo) runs")


def layout(preset: str, tokens: int, dtype: torch.dtype) -> dict[str, object]:
    """One request's KV: per layer [2, blocks, block_size, Hkv, D] (the pool layout, DESIGN.md)."""
    config = get_preset(preset)
    blocks = tokens // BLOCK_SIZE
    layer_shape = [2, blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim]
    layer_bytes = 2 * blocks * BLOCK_SIZE * config.num_kv_heads * config.head_dim * dtype.itemsize
    return {"preset": preset, "tokens": tokens, "blocks": blocks, "num_layers": config.num_layers,
            "layer_shape": layer_shape, "dtype": dtype_name(dtype), "layer_bytes": layer_bytes,
            "bytes": layer_bytes * config.num_layers}


def source_pool(shape: list[int], layer: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """P's values for one layer, the same in both processes (D checks them)."""
    generator = torch.Generator().manual_seed(1000 + layer)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def summary(times_ms: list[float], nbytes: int) -> dict[str, float | list[float]]:
    median = statistics.median(times_ms)
    return {"ms": median, "gbps": nbytes / median / 1e6, "ms_all": [round(t, 3) for t in times_ms]}


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


# ---- the plain peer copy ---------------------------------------------------------------------------------

def peer_copy(kv: dict, devices: list[torch.device], repeat: int) -> dict[str, object]:
    src_dev, dst_dev = devices
    num_layers, layer_elems = int(kv["num_layers"]), int(kv["layer_bytes"]) // 2
    src = torch.empty(num_layers * layer_elems, dtype=torch.bfloat16, device=src_dev).normal_()
    dst = torch.empty(src.shape, dtype=src.dtype, device=dst_dev)

    def timed(step: object) -> list[float]:
        times = []
        for i in range(WARMUP + repeat):
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            t0 = time.perf_counter()
            step()  # type: ignore[operator]
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def per_layer() -> None:
        for layer in range(num_layers):
            dst[layer * layer_elems:(layer + 1) * layer_elems].copy_(src[layer * layer_elems:(layer + 1) * layer_elems])

    return {"whole": summary(timed(lambda: dst.copy_(src)), int(kv["bytes"])),
            "per_layer": summary(timed(per_layer), int(kv["bytes"])),
            "peer_access": torch.cuda.can_device_access_peer(src_dev.index or 0, dst_dev.index or 0)}


# ---- a transfer between two processes ----------------------------------------------------------------------

async def transfer(backend: str, kv: dict, devices: list[torch.device], repeat: int) -> dict[str, object]:
    """D here, P in a child process; P's timings, once D holds P's values."""
    dtype, blocks, shape = DTYPES[str(kv["dtype"])], int(kv["blocks"]), list(kv["layer_shape"])
    pool_shape = [2, 2 * blocks, *shape[2:]]
    pools = [torch.zeros(pool_shape, dtype=dtype, device=devices[1]) for _ in range(int(kv["num_layers"]))]
    completed: dict[str, str] = {}
    receiver = get_backend(backend).receiver(  # type: ignore[call-arg]
        "127.0.0.1", 0, pools, lambda rid, *_: completed.setdefault(rid, "ok"),
        lambda rid, why: completed.setdefault(rid, why), secret=SECRET)
    await receiver.start()
    halves = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    targets = [receiver.expect(f"t{i}", halves[i % 2], None, int(kv["tokens"])) for i in range(WARMUP + repeat)]
    spec = {"backend": backend, "device": str(devices[0]), "kv": kv, "targets": [t.to_dict() for t in targets]}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "_prefill", json.dumps(spec), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=540)
        for _ in range(100):  # D handles the last "done" just after P's finish returned
            if len(completed) == len(targets):
                break
            await asyncio.sleep(0.05)
    finally:
        await receiver.close()
    failed = {rid: why for rid, why in completed.items() if why != "ok"}
    if process.returncode != 0 or failed or len(completed) != len(targets):
        raise RuntimeError(f"{backend} transfer: rc {process.returncode}, {len(completed)}/{len(targets)} ended, "
                           f"failed {failed}; P's stderr: {stderr.decode()[-2000:]}")
    last = halves[(len(targets) - 1) % 2]
    for layer in (0, len(pools) - 1):
        if not torch.equal(pools[layer][:, last].cpu(), source_pool(shape, layer, dtype, torch.device("cpu"))):
            raise RuntimeError(f"{backend}: layer {layer} of D's pool does not hold P's blocks")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    return {**summary(result["wall_ms"], int(kv["bytes"])), "first_ms": result["first_ms"]}


async def prefill_side(spec: dict) -> dict[str, object]:
    kv, device = spec["kv"], torch.device(spec["device"])
    dtype, shape, num_layers = DTYPES[kv["dtype"]], kv["layer_shape"], kv["num_layers"]
    pools = [source_pool(shape, layer, dtype, device) for layer in range(num_layers)]
    sender = get_backend(spec["backend"]).sender(device, secret=SECRET)  # type: ignore[call-arg]
    src = list(range(kv["blocks"]))
    walls = []
    for raw in spec["targets"]:
        target = TransferTarget.from_dict(raw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        sender.begin(target)
        for layer in range(num_layers):
            await sender.send_layer(target.request_id, layer, pools[layer], src, list(target.block_ids))
        await sender.finish(target.request_id, 0, None, kv["tokens"])
        walls.append((time.perf_counter() - t0) * 1e3)
    await sender.close()
    return {"wall_ms": walls[WARMUP:], "first_ms": walls[0]}


# ---- the run -------------------------------------------------------------------------------------------

def host_info(devices: list[torch.device]) -> dict[str, object]:
    info: dict[str, object] = {"torch": torch.__version__, "devices": [str(d) for d in devices],
                               "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE")}
    if all(d.type == "cuda" for d in devices):
        info["gpus"] = [torch.cuda.get_device_name(d) for d in devices]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def run(args: argparse.Namespace) -> dict:
    devices = [torch.device(d) for d in args.devices]
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    kv = layout(args.preset, args.tokens, dtype)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": host_info(devices), "kv": kv,
                    "repeat": args.repeat, "results": {}, "errors": {}}
    for backend in args.backends:
        try:
            if backend == "copy":
                report["results"]["copy"] = peer_copy(kv, devices, args.repeat)
            else:
                report["results"][backend] = asyncio.run(transfer(backend, kv, devices, args.repeat))
        except (RuntimeError, OSError) as exc:  # one backend's failure is a finding; the others still run
            report["errors"][backend] = str(exc)
        write_report(report, args.out)
    copy = report["results"].get("copy")
    for backend in ("cuda_ipc", "nccl"):
        if copy is not None and backend in report["results"]:
            report["results"][backend]["fraction_of_copy"] = report["results"][backend]["gbps"] / copy["whole"]["gbps"]
    return report


def main() -> int:
    if sys.argv[1:2] == ["_prefill"]:
        print(json.dumps(asyncio.run(prefill_side(json.loads(sys.argv[2])))), flush=True)
        return 0
    args = build_parser().parse_args()
    check_args(args)
    report = run(args)
    write_report(report, args.out)
    for name, result in report["results"].items():
        figure = result["whole"] if name == "copy" else result
        print(f"{name}: {figure['ms']:.2f} ms, {figure['gbps']:.1f} GB/s for {report['kv']['bytes'] / 2**20:.0f} MiB")
    for name, error in report["errors"].items():
        print(f"{name} failed: {error}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
