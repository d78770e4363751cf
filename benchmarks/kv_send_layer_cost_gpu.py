"""The prefill step thread's CPU cost of handing one layer to the cuda_ipc sender: per call, in microseconds, of
each way the layer's copy has been enqueued (one GPU, one process, pools of the llama3-8b shape), plus the parts.
JSON to benchmarks/results/.

    python benchmarks/kv_send_layer_cost_gpu.py --out benchmarks/results/kv_send_layer_cost_h200.json

Rows per KV dtype (bf16, fp8), each the mean host time of a call over `--calls` calls (500 copies fit CUDA's
launch queue, so no call waits for the GPU, though the copies may run behind):
- `before`: the sender's path until 2026-12-06: torch.cuda.device + wait_stream + torch.cuda.stream contexts
  around copy_blocks (which checks shapes, ids and strides and works out the grid every call);
- `prepared`: the same contexts around a PreparedCopy (kernels/block_copy.py prepare_copy: checked once);
- `sender`: what CudaIpcKVSender.submit_prepared does now: wait_stream, one set_stream there and back, the
  prepared copy;
- the parts: a Triton launch of an empty kernel, copy_blocks and the prepared copy alone, wait_stream, the two
  contexts entered and left.
transfer_backends.py gives the whole transfer (handshake, finish, D's side) for the same shapes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from kernels_common import cpu_us

from pdserve.kernels.block_copy import copy_blocks, prepare_copy
from pdserve.kv_transfer.cuda_ipc.sender import device_block_ids

BLOCKS = 256  # a 4,096-token prompt in blocks of 16
LAYER = (2, 2 * BLOCKS, 16, 8, 128)  # llama3-8b: 8 KV heads of 128; a pool of twice the request's blocks


@triton.jit
def _empty(x_ptr, n):
    pass


def host_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):  # warm: compiled, allocated
        fn()
    return round(cpu_us(fn, calls), 2)


def rows_for(dtype: torch.dtype, calls: int) -> dict[str, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    src, dst = torch.zeros(LAYER, dtype=dtype, device=device), torch.zeros(LAYER, dtype=dtype, device=device)
    src_ids, dst_ids = device_block_ids(list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS)), device)
    stream = torch.cuda.Stream(device)
    prepared = prepare_copy(src, src_ids, dst, dst_ids)

    def before() -> None:
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                copy_blocks(src, src_ids, dst, dst_ids)

    def prepared_in_contexts() -> None:
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                prepared(src, dst)

    def sender() -> None:
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)
        torch.cuda.set_stream(stream)
        try:
            prepared(src, dst)
        finally:
            torch.cuda.set_stream(compute)

    def contexts() -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            pass

    return {
        "before": host_us(before, calls),
        "prepared": host_us(prepared_in_contexts, calls),
        "sender": host_us(sender, calls),
        "copy_blocks": host_us(lambda: copy_blocks(src, src_ids, dst, dst_ids), calls),
        "prepared_copy": host_us(lambda: prepared(src, dst), calls),
        "wait_stream": host_us(lambda: stream.wait_stream(torch.cuda.current_stream(device)), calls),
        "contexts": host_us(contexts, calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_send_layer_cost.json"))
    args = parser.parse_args()
    x = torch.zeros(16, device="cuda")
    report: dict[str, object] = {
        "command": "python benchmarks/kv_send_layer_cost_gpu.py " + f"--calls {args.calls} --out {args.out}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "unit": "host us a call", "layer_shape": list(LAYER), "blocks": BLOCKS,
        "triton_empty_launch": host_us(lambda: _empty[(1,)](x, 16), args.calls),
    }
    for _ in range(2):  # the first pass warms the host (clocks, caches): only the second is kept
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            report[str(dtype).removeprefix("torch.")] = rows_for(dtype, args.calls)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
