"""One launch of each decode attention form at b64 ctx 4,096 (llama3-8b heads), for Nsight Compute:

    cd benchmarks && ncu --kernel-name regex:_decode_split --launch-skip 3 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
        --section SchedulerStats python3 decode_attention_ncu.py

Each form runs once to compile (the skipped launches), then once to be profiled: bf16 dot 64x4x3, fp8 kt 64x2x2,
fp8 kt+vwide 64x4x3, in that order (H100, 2026-12-06: results/ncu_decode_attention_h100.txt).
"""

import torch
from decode_attention_fp8_gpu import make_shape

from pdserve.kernels.decode_attention_triton import _launch

FORMS = (("bf16", "dot", (64, 4, 3)), ("fp8", "kt", (64, 2, 2)), ("fp8", "kt+vwide", (64, 4, 3)))

shape = make_shape(64, 4096, torch.device("cuda"), copies=1)
for _ in range(2):
    for kind, variant, tile in FORMS:
        _launch(shape["q"], shape[kind][0], shape["lens"], shape["tables"], 0.088, config=tile, variant=variant)
torch.cuda.synchronize()
