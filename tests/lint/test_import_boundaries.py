"""The package boundaries (docs/architecture.md, "Dependencies point one way"), checked twice: statically (tests/lint/import_graph.py
follows every first-party import in the source, lazy ones too) and by importing in a fresh interpreter
(what `sys.modules` holds afterwards, third-party imports included).

The router tokenizes, hashes and relays; it never touches tensors, so the router process never loads torch.
Outside `router/` it may reach only:

    pdserve.protocol                  the router ↔ worker messages (torch-free by its own rule below)
    pdserve.engine.tokenizer, .chat   tokenization and the chat template
    pdserve.engine.sampling_params    validated sampling parameters, sent to the workers
    pdserve.cache_store.hashing       the prompt's chained block hashes (cache-aware routing)

and one module beyond issue 21's list:

    pdserve.engine.structured_output  the type of `SamplingParams.structured`, which sampling_params imports
                                      itself (json and dataclasses only); the router builds it from
                                      `response_format` and tool choices

plus the parent packages that importing those runs (`pdserve`, `pdserve.engine`, `pdserve.cache_store`): their
`__init__` must stay free of imports, or what they import shows up here as a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lint.import_graph import REPO, modules_in, reached_from

ROUTER_PACKAGES = ("pdserve.router", "pdserve.protocol")
ROUTER_MAY_REACH = frozenset({
    "pdserve.engine.tokenizer",
    "pdserve.engine.chat",
    "pdserve.engine.sampling_params",
    "pdserve.engine.structured_output",
    "pdserve.cache_store.hashing",
    "pdserve",
    "pdserve.engine",
    "pdserve.cache_store",
})
# torch, and what imports it or compiles for it
MODEL = "smollm2-135m-instruct"
TENSOR_LIBRARIES = frozenset({"torch", "triton", "transformers", "accelerate", "xgrammar", "safetensors"})
HTTP_LIBRARIES = frozenset({"fastapi", "starlette", "uvicorn", "httpx", "pydantic"})

# package -> (the first-party packages it may import besides itself, third-party libraries it must not import)
LOWER_LAYERS = {
    "pdserve.protocol": ((), TENSOR_LIBRARIES),
    "pdserve.kernels": ((), frozenset()),
    "pdserve.engine": (("pdserve.kernels",), HTTP_LIBRARIES),
    "pdserve.cache_store": (("pdserve.kernels", "pdserve.protocol"), HTTP_LIBRARIES),
    "pdserve.kv_transfer": (("pdserve.kernels", "pdserve.cache_store", "pdserve.protocol"), HTTP_LIBRARIES),
}


def _within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def _router_may_import(module: str) -> bool:
    return _within(module, ROUTER_PACKAGES) or module in ROUTER_MAY_REACH


def test_router_reaches_only_the_allowed_modules() -> None:
    reached = reached_from(modules_in("pdserve.router"))
    outside = [m for m in reached.first_party if not _router_may_import(m)]
    assert not outside, "the router reaches modules outside its boundary:\n" + "\n".join(
        " → ".join(reached.chain(m)) for m in sorted(outside))
    tensors = sorted(set(reached.third_party) & TENSOR_LIBRARIES)
    assert not tensors, "the router imports tensor libraries: " + ", ".join(
        f"{name} (in {reached.third_party[name]})" for name in tensors)


@pytest.mark.parametrize("package", sorted(LOWER_LAYERS))
def test_lower_layers_import_nothing_above_them(package: str) -> None:
    may_import, libraries = LOWER_LAYERS[package]
    reached = reached_from(modules_in(package))
    above = [m for m in reached.first_party if m != "pdserve" and not _within(m, (package, *may_import))]
    assert not above, f"{package} imports packages above it:\n" + "\n".join(
        " → ".join(reached.chain(m)) for m in sorted(above))
    forbidden = sorted(set(reached.third_party) & libraries)
    assert not forbidden, f"{package} imports " + ", ".join(
        f"{name} (in {reached.third_party[name]})" for name in forbidden)


# the worker process (worker/) assembles the nodes over the lower layers; from pdserve/ it takes settings (and
# what settings.py imports: its RestartPolicy comes from supervision.py) and gc_tuning, never the CLI, the
# router, the benchmark client or the planner
WORKER_MUST_NOT_REACH = ("pdserve.router", "pdserve.cli", "pdserve.commands", "pdserve.bench", "pdserve.planner",
                         "pdserve.llm", "pdserve.offline_worker")
NODES = ("pdserve.prefill_node", "pdserve.decode_node")


def test_the_worker_reaches_neither_the_router_nor_the_cli() -> None:
    reached = reached_from(modules_in("pdserve.worker"))
    above = [m for m in reached.first_party if _within(m, WORKER_MUST_NOT_REACH)]
    assert not above, "the worker reaches:\n" + "\n".join(" → ".join(reached.chain(m)) for m in sorted(above))


@pytest.mark.parametrize("package", [*NODES, *sorted(LOWER_LAYERS)])
def test_nothing_below_the_worker_imports_it(package: str) -> None:
    reached = reached_from(modules_in(package))
    worker = [m for m in reached.first_party if _within(m, ("pdserve.worker",))]
    assert not worker, f"{package} reaches the worker:\n" + "\n".join(
        " → ".join(reached.chain(m)) for m in sorted(worker))


def _loaded_after_importing(modules: list[str]) -> list[str]:
    return _loaded_after_running(f"import importlib\nfor name in {modules!r}: importlib.import_module(name)\n")


def _loaded_after_running(code: str) -> list[str]:
    code += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_importing_the_router_loads_no_torch_and_no_worker_code() -> None:
    loaded = _loaded_after_importing(modules_in("pdserve.router"))
    assert "pdserve.router.app" in loaded
    tensors = sorted(m for m in loaded if m.split(".")[0] in TENSOR_LIBRARIES)
    assert not tensors, f"importing the router loads {tensors[:10]}"
    first_party = [m for m in loaded if m.split(".")[0] == "pdserve"]
    outside = sorted(m for m in first_party if not _router_may_import(m))
    assert not outside, f"importing the router loads {outside}"


def test_the_router_command_reads_the_model_without_torch_or_fastapi_at_parse_time(model_cache_dir: Path,
                                                                                   default_model_dir: Path) -> None:
    """`pdserve router` reads the model's tokenizer and limits through engine.weights, and every `pdserve`
    command builds the whole parser first: with the model converted, neither loads torch, and the parser no
    fastapi (they cost each router ~2 s and each command ~0.3-0.9 s of CPU at start, in every deployment)."""
    parse = _loaded_after_running("from pdserve.cli import build_parser\nbuild_parser()")
    assert not [m for m in parse if m.split(".")[0] in (*TENSOR_LIBRARIES, "fastapi", "starlette")], \
        "building the CLI's parser loads " + str([m for m in parse if m.split(".")[0] in ("torch", "fastapi")][:5])
    facts = _loaded_after_running(
        "from pathlib import Path\nfrom pdserve.commands.router import model_facts\n"
        f"name, tokenizer, limit = model_facts('{MODEL}', 'auto', None, None, Path({str(model_cache_dir)!r}))\n"
        "assert tokenizer is not None and limit > 0, (tokenizer, limit)")
    assert "pdserve.engine.weights.locate" in facts
    tensors = sorted(m for m in facts if m.split(".")[0] in (*TENSOR_LIBRARIES, "gguf"))
    assert not tensors, f"reading the model's facts loads {tensors[:10]}"  # gguf: ~0.5 s, only to convert


def test_importing_the_protocol_loads_no_torch_and_nothing_above_it() -> None:
    loaded = _loaded_after_importing(modules_in("pdserve.protocol"))
    assert not [m for m in loaded if m.split(".")[0] in TENSOR_LIBRARIES]
    assert {m for m in loaded if m.split(".")[0] == "pdserve"} - set(modules_in("pdserve.protocol")) == {"pdserve"}


def test_a_worker_loads_xgrammar_only_for_its_first_constrained_request(default_model_dir: Path) -> None:
    """xgrammar (and the transformers it imports) cost every worker ~1.4 s of CPU at start; a worker loads them
    when a request first asks for structured output (engine/grammar.py)."""
    modules = [*modules_in("pdserve.worker"), *NODES]
    code = (f"import importlib\nfor name in {modules!r}: importlib.import_module(name)\n"
            "from pdserve.engine.grammar import GrammarBackend\nfrom pdserve.engine.tokenizer import Tokenizer\n"
            f"backend = GrammarBackend(Tokenizer.from_dir({str(default_model_dir)!r}), 49152, [2])\n"
            "assert not backend.ready")
    loaded = _loaded_after_running(code)
    assert "pdserve.worker.assembly" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("xgrammar", "transformers")]
