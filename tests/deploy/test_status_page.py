"""The router's status page in headless Chromium, against compose's topology: a screenshot saved as a test
artifact (tests/artifacts/status_page.png), and the key numbers in the DOM after the refresh script ran."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.load import MODEL
from tests.deploy.topology import REPO, Topology

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1366,900", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if binary is None:
        pytest.skip("no chromium (apt-get install chromium): the status page is not rendered")
    return binary


def run_chromium(binary: str, profile: Path, *args: str) -> str:
    argv = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, f"chromium failed ({result.returncode}): {result.stderr[-2000:]}"
    return result.stdout


class _TextOf(HTMLParser):
    """Collects the text inside the element with a given id, nested elements included."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr"})

    def __init__(self, element_id: str) -> None:
        super().__init__()
        self.element_id = element_id
        self.depth = 0  # > 0 while inside the element
        self.found = False
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        if self.depth:
            self.depth += 1
        elif dict(attrs).get("id") == self.element_id:
            self.depth, self.found = 1, True

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in self.VOID:
            self.depth -= 1
            self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def element(dom: str, element_id: str) -> str:
    """The text of the element with this id (whitespace collapsed)."""
    parser = _TextOf(element_id)
    parser.feed(dom)
    assert parser.found, f"no #{element_id} in the DOM"
    return " ".join("".join(parser.parts).split())


def as_ms(seconds: float) -> str:
    """The page's own formatting (status_html.py: `ms`)."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def test_status_page_renders_pools_workers_and_percentiles(topology: Topology, chromium: str,
                                                           tmp_path: Path) -> None:
    api = openai.OpenAI(base_url=f"{topology.router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "The same question, four times: what does a status page show?"}]
    replies = [api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
               for _ in range(4)]  # whichever prefill worker each goes to, the later ones find the prompt cached
    assert replies[-1].usage.prompt_tokens_details.cached_tokens >= 16  # P's count reaches the client
    url = f"{topology.router.url}/status"
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "status_page.png"
    screenshot.unlink(missing_ok=True)
    run_chromium(chromium, tmp_path / "shot", f"--screenshot={screenshot}", "--virtual-time-budget=3000", url)
    assert screenshot.stat().st_size > 10_000  # a real page, not a blank one

    dom = run_chromium(chromium, tmp_path / "dom", "--virtual-time-budget=3000", "--dump-dom", url)
    snapshot = httpx.get(f"{topology.router.url}/status.json", timeout=10).json()
    refreshes = re.search(r'<body[^>]*data-refreshes="(\d+)"', dom)
    assert refreshes is not None and int(refreshes.group(1)) >= 1, "the refresh script never rendered status.json"
    latency = snapshot["latency"]
    assert latency["count"] >= 4
    assert element(dom, "ttft-p50") == as_ms(latency["ttft_p50_s"])
    assert element(dom, "ttft-p99") == f"p99 {as_ms(latency['ttft_p99_s'])}"
    assert element(dom, "tpot-p50") == as_ms(latency["tpot_p50_s"])
    assert element(dom, "req-count") == str(latency["count"])
    workers = element(dom, "workers")
    for worker in snapshot["workers"]:
        assert worker["worker_id"] in workers and worker["url"] in workers
    pools = element(dom, "pools")
    for role, pool in snapshot["pools"].items():
        assert f"{role} {pool['workers']} {pool['available']}" in pools, pools
    assert snapshot["cache"]["hit_rate_total"] > 0
    assert element(dom, "cache-recent") == f"{snapshot['cache']['hit_rate_recent'] * 100:.1f} %"
