"""Chooses between a kernel's Triton launcher and its plain-torch reference.

`auto` (the default) runs Triton on CUDA tensors and the reference elsewhere; `ref` forces the references
(for checking a GPU run against them); `triton` forces Triton (for TRITON_INTERPRET=1 runs on CPU).
The backend is set by the entry point (CLI flag or test), never read from the environment here.
"""

from __future__ import annotations

import torch

_BACKENDS = ("auto", "ref", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


def use_triton(x: torch.Tensor) -> bool:
    if _backend == "ref":
        return False
    if _backend == "triton":
        return True
    return x.is_cuda
