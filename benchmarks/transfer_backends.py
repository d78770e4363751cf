"""One request's KV from a prefill process P to a decode process D, by each KV transfer backend side by side in
one run, against one plain copy of the same bytes: tcp, store over shm and over Redis (at several value sizes),
and on GPUs cuda_ipc (one host) and nccl (two GPUs). JSON to benchmarks/results/.

    python benchmarks/transfer_backends.py --presets smollm2-135m llama3-8b:bfloat16 \
        --out benchmarks/results/transfer_backends_cpu.json                     (CPUs: every backend but cuda_ipc)
    python benchmarks/transfer_backends.py --out benchmarks/results/transfer_backends_h200.json     (GPUs: all)
    NCCL_P2P_DISABLE=1 python benchmarks/transfer_backends.py --backends nccl ...   (nccl without peer access)
    OUT=dir bash benchmarks/transfer_backends_h200.sh        (the device call: wheels, redis-server, this script)

By default every backend the devices can run, P and D on the first two GPUs (one GPU: both on it, and nccl,
which needs two ranks on two devices, is listed under `skipped`; no GPU: both on the CPU, nccl over gloo), store
rows at value sizes 0.25, 1, 4 and 16 MiB.

Every backend is built through the kv_transfer registry as a worker builds it, and both sides run on the event
loop a worker's does (uvloop where it is installed, as uvicorn picks it; `host.event_loop`). D is this process (the receiver,
pool of 2 x the request's blocks: transfers alternate halves); P is a child process (`_prefill SPEC`) that sends
the way the prefill engine does: `prepare_sends` once, `submit_prepared` for every layer from a compute thread,
then `await finish`. P starts a transfer only once D completed the previous one, `repeat` times after 2 warm-ups
(handshake, Triton compile, store connections). Per transfer: `ms` is P's first layer handed over -> D's
on_complete (CLOCK_MONOTONIC, shared by the processes of a host), the figure that matters; `p_ms` P's part alone
(first layer -> finish returned: for store, D may still be loading then), split into `p_layers_ms` (the
compute thread's own span: prepare_sends and every layer handed over) and `p_finish_ms` (finish), with
`done_to_d_ms` from finish returned to D's on_complete (negative when D heard first), `d_first_layer_ms` and
`d_last_layer_ms` from P's start to D recording its first and last layer (not cuda_ipc, whose "done" records all),
`p_ready_*`, `p_summed_*`, `p_sent_*` when P's staged senders passed each stage (benchmarks/transfer_stages.py); `p_cpu_ms`, `d_cpu_ms`,
`server_cpu_ms` the CPU time each transfer cost P's process, D's and the redis-server started here, `cpu_ms`
their sum: what other load on a shared machine changes least. D checks that the last transfer's blocks
hold P's values. store-redis uses --redis-url or starts a redis-server on loopback (skipped, and said so, when
there is neither); store-shm a fresh directory in /dev/shm. The copy: one copy_ of all the bytes and one per layer
from P's device to D's. A preset takes the devices' dtype (bf16 on CUDA, fp32 on CPU) unless it names one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch
from transfer_common import WARMUP, Skipped, Stores, plain_copy, summary, synchronize, write_report
from transfer_stages import parts as stage_parts
from transfer_stages import timed_stages

from pdserve.cache_store.kv_codec import DTYPES
from pdserve.cache_store.shared_store import open_store
from pdserve.engine.presets import get_preset
from pdserve.kv_transfer.base import ChunkSend, KVSender
from pdserve.kv_transfer.registry import TransferEnv, get_backend
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import dtype_name

T = TypeVar("T")

BLOCK_SIZE = 16
SECRET = "transfer-backends-benchmark"
FINGERPRINT = "transfer-backends-benchmark"
BACKENDS = ("copy", "tcp", "cuda_ipc", "nccl", "store-shm", "store-redis")
GPU_ONLY = ("cuda_ipc",)
CHUNK_MIB = (0.25, 1.0, 4.0, 16.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of KV in the request (whole blocks)")
    parser.add_argument("--presets", nargs="+", default=["smollm2-135m", "llama3-8b"], metavar="PRESET[:DTYPE]",
                        help="model shapes (engine/presets.py), each with an optional dtype, e.g. llama3-8b:bfloat16")
    parser.add_argument("--repeat", type=int, default=3, help="timed transfers per backend (after 2 warm-ups)")
    parser.add_argument("--backends", nargs="+", default=None, choices=BACKENDS,
                        help="default: every backend the devices can run")
    parser.add_argument("--chunk-mib", nargs="+", type=float, default=list(CHUNK_MIB),
                        help="store backends: the largest value, MiB (each size is one row)")
    parser.add_argument("--devices", nargs=2, default=None, metavar=("P", "D"),
                        help="default: cuda:0 cuda:1, cuda:0 cuda:0 with one GPU, cpu cpu with none")
    parser.add_argument("--redis-url", default=None, help="store-redis: this server (default: start one)")
    parser.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 1) // 2),
                        help="torch threads of P and of D, default half the cores each, as `pdserve serve` gives "
                             "a P and a D (pdserve/launch_plan.py): with 2 each on 2 busy cores one 256 KiB "
                             "index_copy_ took 4.8 ms instead of 0.13 ms (OpenMP threads waiting for each other)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/transfer_backends.json"))
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Fills the defaults that depend on the host (devices, backends); refuses what cannot run at all."""
    if args.tokens <= 0 or args.tokens % BLOCK_SIZE:
        raise SystemExit(f"--tokens must be a positive multiple of {BLOCK_SIZE}, got {args.tokens}")
    if args.repeat < 1 or args.torch_threads < 1:
        raise SystemExit(f"--repeat and --torch-threads must be >= 1, got {args.repeat}, {args.torch_threads}")
    if min(args.chunk_mib) <= 0:
        raise SystemExit(f"--chunk-mib must be positive, got {args.chunk_mib}")
    gpus = torch.cuda.device_count()
    args.devices = args.devices or (["cuda:0", f"cuda:{min(gpus, 2) - 1}"] if gpus else ["cpu", "cpu"])
    on_cpu = [d for d in args.devices if not d.startswith("cuda")]
    args.backends = args.backends or [b for b in BACKENDS if not (on_cpu and b in GPU_ONLY)]
    gpu_only = [b for b in args.backends if b in GPU_ONLY]
    if on_cpu and gpu_only:
        raise SystemExit(f"{gpu_only} need CUDA devices, --devices is {args.devices}")
    missing = [d for d in args.devices if d.startswith("cuda") and (torch.device(d).index or 0) >= gpus]
    if missing:
        raise SystemExit(f"--devices {args.devices}: this host has {gpus} CUDA devices")


def unrunnable(backend: str, devices: list[torch.device]) -> str | None:
    """Why a row cannot run on these devices (it is listed under `skipped`), or None."""
    if backend == "nccl" and devices[0].type == "cuda" and devices[0] == devices[1]:
        return f"nccl needs two GPUs (one rank each), P and D are both {devices[0]}"
    return None


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


# ---- a transfer between two processes ----------------------------------------------------------------------

def environment(spec: dict, device: torch.device) -> TransferEnv:
    store = spec.get("store")
    return TransferEnv(device=device, secret=SECRET, model_fingerprint=FINGERPRINT,
                       store=open_store(store["kind"], store["dir"], store["url"]) if store else None,
                       chunk_bytes=int(spec.get("chunk_bytes", 4 << 20)))


async def transfer(spec: dict, kv: dict, devices: list[torch.device], repeat: int,
                   server_cpu: Callable[[], float] | None = None) -> dict[str, object]:
    """D here, P in a child process that starts each transfer once D completed the previous one. Besides the
    times, the CPU seconds that each transfer cost P, D and the store's server (`server_cpu`, where known): the
    figure that other load on the machine changes least."""
    dtype, blocks, shape = DTYPES[str(kv["dtype"])], int(kv["blocks"]), list(kv["layer_shape"])
    pools = [torch.zeros([2, 2 * blocks, *shape[2:]], dtype=dtype, device=devices[1])
             for _ in range(int(kv["num_layers"]))]
    ended: dict[str, tuple[float, str]] = {}
    changed = asyncio.Event()

    def end(rid: str, outcome: str) -> None:
        ended.setdefault(rid, (time.monotonic(), outcome))
        changed.set()

    receiver = get_backend(spec["backend"]).build_receiver(
        environment(spec, devices[1]), pools, lambda rid, *_: end(rid, "ok"), lambda rid, why: end(rid, why))
    layer_times = timed_layers(receiver)
    await receiver.start()
    halves = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    targets = [receiver.expect(f"t{i}", halves[i % 2], None, int(kv["tokens"])) for i in range(WARMUP + repeat)]
    child = {**spec, "device": str(devices[0]), "kv": kv, "targets": [t.to_dict() for t in targets],
             "threads": torch.get_num_threads()}
    process = await asyncio.create_subprocess_exec(sys.executable, __file__, "_prefill", json.dumps(child),
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE)
    times, p_times, cpu = [], [], {"p_cpu_ms": [], "d_cpu_ms": [], "server_cpu_ms": []}
    parts: dict[str, list[float]] = {"p_layers_ms": [], "p_finish_ms": [], "done_to_d_ms": []}
    try:
        for target in targets:
            d_cpu, s_cpu = time.process_time(), server_cpu() if server_cpu else 0.0
            process.stdin.write(b"go\n")
            await process.stdin.drain()
            line = await asyncio.wait_for(process.stdout.readline(), timeout=300)
            if not line:
                break
            sent = json.loads(line)
            async with asyncio.timeout(120):
                while target.request_id not in ended:
                    changed.clear()
                    await changed.wait()
            done_at, outcome = ended[target.request_id]
            if outcome != "ok":
                raise RuntimeError(f"{spec['name']}: {target.request_id} failed on D: {outcome}")
            times.append((done_at - sent["t0"]) * 1e3)
            p_times.append((sent["t1"] - sent["t0"]) * 1e3)
            for name, (a, b) in (("p_layers_ms", sent["layers"]), ("p_finish_ms", (sent["finish"], sent["t1"])),
                                 ("done_to_d_ms", (sent["t1"], done_at))):
                parts[name].append((b - a) * 1e3)
            if seen := layer_times.get(target.request_id):  # layer by layer (not cuda_ipc: its "done" says all)
                for name, at in (("d_first_layer_ms", seen[0]), ("d_last_layer_ms", seen[-1])):
                    parts.setdefault(name, []).append((at - sent["t0"]) * 1e3)
            for name, value in sent["stages"].items():  # P's staged senders: benchmarks/transfer_stages.py
                parts.setdefault(name, []).append(value)
            cpu["p_cpu_ms"].append(sent["cpu"] * 1e3)
            cpu["d_cpu_ms"].append((time.process_time() - d_cpu) * 1e3)
            cpu["server_cpu_ms"].append(((server_cpu() if server_cpu else 0.0) - s_cpu) * 1e3)
        process.stdin.close()
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
        await receiver.close()
    exit_note = f"P exited {process.returncode} after {len(times)}/{len(targets)} transfers; its stderr: " \
                f"{stderr.decode()[-2000:]}"
    if len(times) != len(targets):
        raise RuntimeError(f"{spec['name']}: {exit_note}")
    last = halves[(len(targets) - 1) % 2]
    for layer in (0, len(pools) - 1):
        if not torch.equal(pools[layer][:, last].cpu(), source_pool(shape, layer, dtype, torch.device("cpu"))):
            raise RuntimeError(f"{spec['name']}: layer {layer} of D's pool does not hold P's blocks")
    nbytes = int(kv["bytes"])
    costs = {name: statistics.median(values[WARMUP:]) for name, values in cpu.items() if server_cpu or
             name != "server_cpu_ms"}
    result = {**summary(times[WARMUP:], nbytes), "p_ms": statistics.median(p_times[WARMUP:]),
              **{name: statistics.median(values[WARMUP:]) for name, values in parts.items()}, **costs,
              "cpu_ms": sum(costs.values()), "first_ms": times[0]}
    # every transfer done and checked, then P failed on its way out (seen: gloo's threads at exit, 1 run in 3):
    # the figures stand, the exit is reported under `warnings`
    return {**result, "p_exit": exit_note} if process.returncode != 0 else result


def timed_layers(receiver: object) -> dict[str, list[float]]:
    """When D recorded each layer of each request (monotonic), by wrapping its table's record_layer: with P's t0,
    how long the first layer took to land (the pipeline's fill) and the last (the stream's end)."""
    times: dict[str, list[float]] = {}
    table = receiver.table  # type: ignore[attr-defined]
    record = table.record_layer

    def timed(request_id: str, layer: int, block_ids: list[int]) -> None:
        times.setdefault(request_id, []).append(time.monotonic())
        record(request_id, layer, block_ids)
    table.record_layer = timed
    return times


def compute_thread(sender: KVSender, chunk: ChunkSend, pools: list[torch.Tensor]) -> tuple[float, float]:
    """As the prefill engine's step thread: the sends prepared once, then every layer handed over. Returns when
    it started and ended (monotonic)."""
    start = time.monotonic()
    sends = sender.prepare_sends([chunk])
    for layer in range(len(pools)):
        sender.submit_prepared(sends, layer, pools[layer])
    if sends.failed:
        raise RuntimeError(f"sends failed: {sends.failed}")
    return start, time.monotonic()


async def prefill_side(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    kv, device = spec["kv"], torch.device(spec["device"])
    dtype, shape, num_layers = DTYPES[kv["dtype"]], kv["layer_shape"], kv["num_layers"]
    pools = [source_pool(shape, layer, dtype, device) for layer in range(num_layers)]
    sender = get_backend(spec["backend"]).build_sender(environment(spec, device), None)
    stages = timed_stages(sender)
    src = tuple(range(kv["blocks"]))
    for raw in spec["targets"]:
        if not await asyncio.to_thread(sys.stdin.readline):
            break
        target = TransferTarget.from_dict(raw)
        synchronize(device)
        t0, cpu = time.monotonic(), time.process_time()
        sender.begin(target)

        layers = await asyncio.to_thread(compute_thread, sender, ChunkSend(target.request_id, src, target.block_ids),
                                         pools)
        finish = time.monotonic()
        await sender.finish(target.request_id, 0, None, kv["tokens"])
        print(json.dumps({"t0": t0, "t1": time.monotonic(), "layers": layers, "finish": finish,
                          "cpu": time.process_time() - cpu, "stages": stage_parts(stages, t0)}), flush=True)
    await sender.close()


# ---- the run -------------------------------------------------------------------------------------------

def runs(args: argparse.Namespace) -> list[dict]:
    """(name, backend, chunk) of every row: store backends once per chunk size."""
    rows = []
    for name in args.backends:
        if not name.startswith("store-"):
            rows.append({"name": name, "backend": name})
            continue
        for mib in args.chunk_mib:
            rows.append({"name": f"{name}@{mib:g}MiB", "backend": "store", "kind": name.split("-")[1],
                         "chunk_bytes": int(mib * (1 << 20))})
    return rows


def workers_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop factory of a worker's event loop: uvicorn's "auto" takes uvloop when it is importable."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_on_workers_loop(coro: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=workers_loop()) as runner:
        return runner.run(coro)


def host_info(devices: list[torch.device]) -> dict[str, object]:
    info: dict[str, object] = {"torch": torch.__version__, "devices": [str(d) for d in devices],
                               "event_loop": workers_loop().__module__,
                               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                               "load_before": os.getloadavg()[0],
                               "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE")}
    if all(d.type == "cuda" for d in devices):
        info["gpus"] = [torch.cuda.get_device_name(d) for d in devices]
    return info


def run(args: argparse.Namespace) -> dict:
    devices = [torch.device(d) for d in args.devices]
    report: dict = {"command": shlex.join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
                    "host": host_info(devices), "repeat": args.repeat, "presets": {}, "errors": {}, "skipped": {},
                    "warnings": {}}
    stores = Stores(args.redis_url)
    try:
        for item in args.presets:
            preset, _, dtype_text = item.partition(":")
            dtype = DTYPES[dtype_text] if dtype_text else torch.bfloat16 if devices[0].type == "cuda" else torch.float32
            kv = layout(preset, args.tokens, dtype)
            results: dict[str, dict] = {}
            name = item  # "llama3-8b", or "llama3-8b:float8_e4m3fn": one entry per preset and dtype asked for
            report["presets"][name] = {"kv": kv, "results": results}
            for row in runs(args):
                try:
                    if why := unrunnable(row["backend"], devices):
                        raise Skipped(why)
                    if row["name"] == "copy":
                        results["copy"] = plain_copy(kv, devices, args.repeat)
                    else:
                        spec = {**row, "store": stores.spec(row["kind"]) if "kind" in row else None}
                        server_cpu = stores.server_cpu if row.get("kind") == "redis" and not args.redis_url else None
                        results[row["name"]] = run_on_workers_loop(transfer(spec, kv, devices, args.repeat, server_cpu))
                        if "p_exit" in results[row["name"]]:
                            report["warnings"][f"{name}/{row['name']}"] = results[row["name"]].pop("p_exit")
                except Skipped as exc:
                    report["skipped"][f"{name}/{row['name']}"] = str(exc)
                except (RuntimeError, OSError, TimeoutError) as exc:  # a finding; the other rows still run
                    report["errors"][f"{name}/{row['name']}"] = str(exc)
                write_report(report, args.out)
            relative_to(results, "tcp")
    finally:
        stores.close()
    report["host"]["load_after"] = os.getloadavg()[0]
    return report


def relative_to(results: dict[str, dict], base: str) -> None:
    if base in results:
        for result in results.values():
            if "ms" in result:
                result[f"vs_{base}"] = result["ms"] / results[base]["ms"]


def main() -> int:
    if sys.argv[1:2] == ["_prefill"]:
        run_on_workers_loop(prefill_side(json.loads(sys.argv[2])))
        return 0
    args = build_parser().parse_args()
    check_args(args)
    torch.set_num_threads(args.torch_threads)
    report = run(args)
    write_report(report, args.out)
    for preset, entry in report["presets"].items():
        mib = entry["kv"]["bytes"] / 2**20
        for name, result in entry["results"].items():
            figure = result["whole"] if name == "copy" else result
            extra = f", P's part {result['p_ms']:.1f} ms, {result['cpu_ms']:.0f} CPU ms" if "p_ms" in result else ""
            ratio = f", {result['vs_tcp']:.2f}x tcp's time" if "vs_tcp" in result else ""
            print(f"{preset} {name}: {figure['ms']:.2f} ms, {figure['gbps']:.2f} GB/s for {mib:.0f} MiB{extra}{ratio}")
    for name, note in report["warnings"].items():
        print(f"{name}: {note}")
    for name, why in report["skipped"].items():
        print(f"{name} not run: {why}")
    for name, error in report["errors"].items():
        print(f"{name} failed: {error}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
