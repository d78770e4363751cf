"""`pdserve serve HuggingFaceTB/SmolLM2-135M-Instruct` with vLLM's flags, offline: the repo id is found in a hub
cache made here from the default model's converted files (HF_HOME, HF_HUB_OFFLINE=1: nothing may be downloaded),
served under two --served-model-names over TLS, with a --chat-template file, CORS for one origin, an admin token
passed by environment, and prefix caching off. One real deployment (router + P + D), checked with the official
`openai` client and plain HTTP.

And a repo id that is not in the cache: `pdserve serve` stops at once, saying what it looked for and where,
without a traceback."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup
from tests.engine.hub_cache import REPO_ID, make_hub_cache

READY_TIMEOUT_S = 240.0
ADMIN_TOKEN = "hub-test-admin-token"
TEMPLATE = "{{ bos_token }}The capital of France is"  # ignores the messages: every chat asks the same
ORIGIN = "https://app.example"


@dataclass
class Served:
    group: ProcessGroup
    url: str
    cert: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=str(self.cert)), timeout=60)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = tmp / "key.pem", tmp / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _serve(argv: list[str], env: dict[str, str], log_path: Path) -> ProcessGroup:
    return ProcessGroup([sys.executable, "-m", "pdserve.cli", "serve", *argv], log_path, env).start()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    make_hub_cache(home / "hub", default_model_dir)
    return home


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hf_home: Path, model_cache_dir: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve_hub")
    key, cert = _self_signed(tmp)
    (tmp / "template.jinja").write_text(TEMPLATE)
    port = free_port("127.0.0.1")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PDSERVE_CACHE_DIR": str(model_cache_dir)}
    env.pop("HF_HUB_CACHE", None)
    argv = [REPO_ID, "--port", str(port), "--served-model-name", "smol", "smol-alias",
            "--chat-template", str(tmp / "template.jinja"), "--allowed-origins", ORIGIN,
            "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--admin-token", ADMIN_TOKEN,
            "--no-enable-prefix-caching", "--seed", "7", "--num-blocks", "256", "--torch-threads", "1"]
    group = _serve(argv, env, tmp / "serve.log")
    server = Served(group, f"https://127.0.0.1:{port}", cert, tmp / "serve.log")
    try:
        group.wait_until(lambda: "pdserve ready" in server.log(), READY_TIMEOUT_S, "pdserve serve", poll_s=0.3)
        yield server
    finally:
        group.stop(grace_s=20)


def test_the_repo_id_is_served_under_its_names_over_tls(served: Served) -> None:
    assert f"pdserve ready: {served.url}/v1" in served.log()
    with served.client() as client:
        models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smol", "smol-alias"]
    with pytest.raises(httpx.ConnectError):  # TLS only: no certificate check, no connection
        httpx.get(f"{served.url}/v1/models", timeout=10)


def test_chat_uses_the_template_file(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0,
                           http_client=served.client())
    answers = [client.chat.completions.create(model=name, messages=[{"role": "user", "content": text}],
                                              max_tokens=4, temperature=0)
               for name, text in (("smol", "Tell me a joke"), ("smol-alias", "What is 2 + 2? Think step by step."))]
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens  # the template ignores the message
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert "Paris" in answers[0].choices[0].message.content


def test_prefix_caching_is_off(served: Served) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # ~80 tokens: five full blocks
    with served.client() as client:
        for _ in range(2):
            reply = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cors_answers_the_allowed_origin_only(served: Served) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with served.client() as client:
        allowed = client.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
        other = client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        simple = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_the_admin_token_works_and_is_on_no_command_line(served: Served) -> None:
    with served.client() as client:
        workers = client.get("/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert workers.status_code == 200, workers.text
    assert sorted(w["worker_id"] for w in workers.json()["workers"]) == ["decode-0", "prefill-0"]
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        assert ADMIN_TOKEN.encode() not in cmdline or b"pytest" in cmdline


def test_a_repo_missing_from_the_cache_is_a_clear_error(tmp_path: Path, hf_home: Path) -> None:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    group = _serve(["org/absent", "--revision", "v1", "--port", str(free_port("127.0.0.1"))], env,
                   tmp_path / "serve.log")
    try:
        group.wait_until(group.exited, 120, "the exit")
    finally:
        group.stop(grace_s=20)
    log = (tmp_path / "serve.log").read_text()
    assert group.returncode == 1, log
    for part in ("'org/absent' (revision v1) is not in the Hugging Face cache", str(hf_home / "hub"),
                 "HF_HUB_OFFLINE is set", "router (pid"):
        assert part in log, log
    assert "Traceback" not in log, log
