"""What Triton compiles a launch under, and two ways to watch it: a recorder of launch keys (no GPU needed)
and a counter of compiles (on a GPU).

Triton (3.6 and 3.8, `JITFunction.run`) keeps one compiled kernel per

    (every constexpr's value, every other argument's type and class, the launch options)

where an integer's class is `== 1` (it then becomes a constexpr) or `% 16 == 0` or neither, unless the kernel
marks it do_not_specialize; a tensor's is its dtype and whether its address is 16-byte aligned; floats and
bools have none. A key first seen while serving is a compile on the request path (1.5 s for the prefill
attention kernel on this machine's ptxas). `launch_key` applies that rule to a launch's arguments
(tests/kernels/test_specialization.py checks it against Triton's own where Triton exposes it), and
`LaunchRecorder` collects the keys of every launch of this package's kernels, running them or not: on "meta"
tensors nothing runs, so a CPU test can push a model's served batches through the real launchers and
compare the keys they reach with the warm-up's (tests/engine/test_prefill_warm_up.py). `CompileCounter`
counts the compiles that really happen, through Triton's post-compile hook.
"""

import functools
import importlib
import inspect
import pkgutil
from typing import Self

import torch
import triton

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "u1",
           torch.float64: "fp64"}


@functools.cache
def _params(kernel) -> tuple:
    """(name, is constexpr, value specialised, alignment specialised, default) per parameter of a jit kernel."""
    dns = getattr(kernel, "do_not_specialize", None)
    dns_align = getattr(kernel, "do_not_specialize_on_alignment", None)
    if dns is None:  # the interpreter's InterpretedFunction keeps the decorator's arguments instead
        dns = kernel.kwargs.get("do_not_specialize") or ()
        dns_align = kernel.kwargs.get("do_not_specialize_on_alignment") or ()
    dns_align = dns_align or ()
    out = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        out.append((p.name, "constexpr" in str(p.annotation), i not in dns and p.name not in dns,
                    i not in dns_align and p.name not in dns_align, p.default))
    return tuple(out)


def _aligned(t: torch.Tensor) -> bool:
    if t.device.type == "meta":  # no address: allocations are >= 16-byte aligned, so the view's offset decides
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def arg_key(value, specialize: bool = True, align: bool = True) -> tuple:
    """(type, class) of one non-constexpr argument, as Triton's specialize_impl gives it."""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        kind = "i32" if -(2**31) <= value < 2**31 else "u64" if 2**63 <= value < 2**64 else "i64"
        return (kind, ("D" if align and value % 16 == 0 else "") if specialize else None)
    if isinstance(value, float):
        return ("fp32", None)
    if isinstance(value, torch.Tensor):
        kind = "*" + _DTYPES.get(value.dtype, str(value.dtype))
        return (kind, ("D" if align and _aligned(value) else "") if specialize else None)
    raise TypeError(f"no Triton specialisation rule for a {type(value).__name__} argument")


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key `kernel[grid](*args, **kwargs)` is compiled under: (kernel name, per-argument key, options)."""
    params = _params(kernel)
    spec = []
    for i, (name, constexpr, specialize, align, default) in enumerate(params):
        value = args[i] if i < len(args) else kwargs.get(name, default)
        spec.append(("constexpr", value) if constexpr else arg_key(value, specialize, align))
    names = {p[0] for p in params}
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return (kernel.fn.__name__, tuple(spec), options)


def kernel_modules() -> list:
    """Every `*_triton` module of this package (where the launchers and their kernels live)."""
    import pdserve.kernels as package

    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)
            if m.name.endswith("_triton")]


def launched_kernels(module) -> dict:
    """The module's launched kernels by attribute name: jit functions named `_*_kernel` (the device helpers
    they call, such as `_attend_block`, are resolved by name when a kernel compiles: never replace those)."""
    return {name: obj for name, obj in vars(module).items()
            if name.endswith("_kernel") and isinstance(obj, triton.runtime.KernelInterface)}


class _Recording:
    def __init__(self, kernel, recorder: "LaunchRecorder") -> None:
        self.kernel = kernel
        self.recorder = recorder

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.recorder.keys.add(launch_key(self.kernel, args, kwargs))
            self.recorder.launches += 1
            if self.recorder.run:
                return self.kernel[grid](*args, **kwargs)
            return None

        return launch


class LaunchRecorder:
    """`with LaunchRecorder(run=False) as rec:` ... then `rec.keys`: every distinct launch key seen.

    Replaces the kernels of every `*_triton` module by recording stand-ins while active (the launchers look
    their kernel up as a module global at each call). With run=False nothing is launched, so outputs are
    left uninitialised: meant for shape-only ("meta") runs. Not thread-safe; one recorder at a time."""

    def __init__(self, run: bool = True) -> None:
        self.run = run
        self.keys: set[tuple] = set()
        self.launches = 0
        self._saved: list[tuple] = []

    def __enter__(self) -> Self:
        for module in kernel_modules():
            for name, kernel in launched_kernels(module).items():
                self._saved.append((module, name, kernel))
                setattr(module, name, _Recording(kernel, self))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, kernel in reversed(self._saved):
            setattr(module, name, kernel)
        self._saved.clear()


class CompileCounter:
    """`with CompileCounter() as c:` ... then `c.compiled`: a line per Triton compile (an in-memory cache miss;
    a hit in Triton's on-disk cache counts too, since it is loaded on the request path all the same).

    Through `triton.knobs.runtime.jit_post_compile_hook` (Triton >= 3.4, so 3.6 and 3.8); a hook set before
    is called as well and put back afterwards. `cached_kernels()` counts the compiled kernels held by this
    package's jit functions, a cross-check that needs no hook."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self._previous = None

    def __enter__(self) -> Self:
        runtime = triton.knobs.runtime
        self._previous = previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.compiled.append(str(kwargs.get("repr", args[:1])))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_post_compile_hook = self._previous


def cached_kernels() -> int:
    """Compiled kernels held in the in-memory caches of this package's jit functions, all devices."""
    total = 0
    for module in kernel_modules():
        for kernel in launched_kernels(module).values():
            for caches in getattr(kernel, "device_caches", {}).values():
                total += len(caches[0])  # (kernel cache, ...) in Triton 3.6 and 3.8
    return total
