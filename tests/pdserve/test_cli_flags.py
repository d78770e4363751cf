"""The command line as a vLLM user meets it: every flag has help and shows its default, `serve MODEL` is
`serve --model MODEL`, every router flag is reachable from `serve` and reaches the router (secrets by
environment), vLLM's on/off spelling works from the environment too."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cli import HelpFormatter, build_parser
from pdserve.commands.docs import hidden_pdserve_env
from pdserve.commands.serve import _settings, child_environment
from pdserve.config_doc import iter_commands
from pdserve.env_flags import apply_env_defaults
from pdserve.router.cors import CorsSettings
from pdserve.router_flags import add_router_arguments, parse_list, read_chat_template, router_config
from pdserve.router_server import ListenSettings
from pdserve.worker.flags import add_worker_arguments, worker_settings_from_args

# the router's flags that `pdserve serve` sets itself: the workers it starts, the TLS side listener's port
SERVE_OWNS = {"--prefill", "--decode", "--internal-port", "--fd", "--internal-fd"}  # serve sets or has no use for them


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    with hidden_pdserve_env():
        return build_parser()


def _options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_help_that_shows_its_default(parser: argparse.ArgumentParser) -> None:
    bare = []
    for command, sub in iter_commands(parser):
        formatter = HelpFormatter(command)
        for action in _options(sub):
            shown = formatter._get_help_string(action)
            text = (action.help or "").split(" [env ")[0].strip()
            if not text or ("default" not in shown and not action.required):
                bare.append(f"{command} {action.option_strings[0]}")
    assert not bare, f"flags without help or a shown default: {bare}"
    assert "(default: 8000)" in parser._subparsers._group_actions[0].choices["serve"].format_help()


def test_model_is_positional_as_in_vllm(parser: argparse.ArgumentParser) -> None:
    for command in ("serve", "router", "prefill", "decode"):
        assert parser.parse_args([command, "org/name"]).model == "org/name"
        assert parser.parse_args([command, "--model", "org/name"]).model == "org/name"
        assert parser.parse_args([command]).model == "smollm2-135m-instruct"
    assert parser.parse_args(["model", "fetch", "org/name"]).model == "org/name"


def test_every_router_flag_is_reachable_from_serve_and_reaches_the_router(parser: argparse.ArgumentParser) -> None:
    choices = parser._subparsers._group_actions[0].choices
    router_flags = {f for a in _options(choices["router"]) for f in a.option_strings}
    serve_flags = {f for a in _options(choices["serve"]) for f in a.option_strings}
    assert router_flags - serve_flags == SERVE_OWNS
    args = parser.parse_args(["serve", "org/name", "--served-model-name", "a", "b", "--prefill-policy",
                              "round_robin", "--allowed-origins", '["https://app.example"]', "--ssl-keyfile", "k",
                              "--ssl-certfile", "c", "--disable-log-requests", "--disable-log-stats",
                              "--log-stats-interval", "2.5", "--admin-token", "admin-secret",
                              "--api-key", "key-secret", "--no-enable-prefix-caching", "--log-level", "debug",
                              "--busy-local-prefill-tokens", "128", "--busy-prefill-backlog", "512"])
    settings = _settings(args)
    router = " ".join(settings.router_args)
    for words in ("--model org/name", "--served-model-name a b", "--prefill-policy round_robin",
                  "--allowed-origins https://app.example", "--ssl-keyfile k --ssl-certfile c",
                  "--disable-log-requests", "--disable-log-stats", "--log-stats-interval 2.5", "--log-level debug",
                  "--busy-local-prefill-tokens 128", "--busy-prefill-backlog 512"):
        assert words in router, router
    workers = " ".join(settings.worker_args)
    assert "--served-model-name a b" in workers and "--no-enable-prefix-caching" in workers
    assert "prefill-policy" not in workers and settings.router_tls
    assert "secret" not in router + workers  # tokens never on a command line
    env = child_environment({}, args.api_key, args.admin_token)
    assert env["PDSERVE_ADMIN_TOKEN"] == "admin-secret" and env["PDSERVE_API_KEY"] == "key-secret"
    reparsed = parser.parse_args(["router", *settings.router_args])
    assert reparsed.served_model_name == ["a", "b"] and reparsed.allowed_origins == ["https://app.example"]
    config = router_config(reparsed, "a", (), 2048, None)
    assert not config.log_requests and not config.log_stats and config.log_stats_interval_s == 2.5
    assert config.busy_local_prefill_tokens == 128 and config.busy_prefill_backlog == 512
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile"):
        _settings(parser.parse_args(["serve", "--ssl-certfile", "c"]))


def test_vllm_on_off_flag_and_its_variable() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="prefill")
    assert parser.parse_args([]).enable_prefix_caching is True
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    apply_env_defaults(parser, {"PDSERVE_ENABLE_PREFIX_CACHING": "0"})
    args = parser.parse_args(["--device", "cpu"])
    settings = worker_settings_from_args(args, None, None)
    assert settings.cache.enable_prefix_caching is False
    with pytest.raises(ValueError, match="host .* and Redis .* tiers would hold nothing"):
        worker_settings_from_args(parser.parse_args(["--device", "cpu", "--host-cache-gb", "1"]), None, None)


def test_kv_cache_dtype_takes_the_vllm_and_sglang_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    """fp8 and fp8_e4m3 (vLLM's two names of its e4m3 cache, SGLang's only one) give one setting, from the command
    line and from the environment; fp8_e5m2, which SGLang and vLLM also take, is refused naming what is taken."""
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="decode")
    for flags in (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales"]):
        settings = worker_settings_from_args(parser.parse_args(["--device", "cpu", *flags]), None, None)
        assert settings.model.kv_cache_dtype == "fp8"
    assert worker_settings_from_args(parser.parse_args(["--device", "cpu"]), None, None).model.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    err = capsys.readouterr().err  # choices quoted or not by Python version
    assert "--kv-cache-dtype: invalid choice: 'fp8_e5m2'" in err and "fp8_e4m3" in err.split("choose from")[1]
    apply_env_defaults(parser, {"PDSERVE_KV_CACHE_DTYPE": "fp8_e4m3"})
    assert worker_settings_from_args(parser.parse_args(["--device", "cpu"]), None, None).model.kv_cache_dtype == "fp8"


def test_a_cache_without_prefix_caching_never_finds_a_prefix() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool, block_size=4, enabled=False)
    hashes = [b"a", b"b"]
    first = cache.allocate(hashes, 3)
    assert cache.commit(hashes, first.block_ids) == 0
    pool.free(first.block_ids)
    again = cache.allocate(hashes, 3)
    assert again.num_cached_tokens == 0 and cache.peek(hashes).num_blocks == 0
    pool.free(again.block_ids)
    assert pool.num_free == 8


def test_router_http_settings_refuse_half_configurations(tmp_path) -> None:
    assert parse_list('["https://a.example", "http://b:3000"]') == ["https://a.example", "http://b:3000"]
    assert parse_list("https://a, https://b") == ["https://a", "https://b"]
    with pytest.raises(ValueError, match="scheme://host"):
        CorsSettings(allowed_origins=("a.example",))
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        ListenSettings(ssl_keyfile="k")
    with pytest.raises(ValueError, match="plain listener beside a TLS one"):
        ListenSettings(internal_port=9000)
    assert ListenSettings(ssl_keyfile="k", ssl_certfile="c", port=8443).url == "https://127.0.0.1:8443"
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(SystemExit, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_router_flags_module_is_complete_for_a_bare_parser() -> None:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser, internal_port=False)
    assert "--internal-port" not in {f for a in parser._actions for f in a.option_strings}


@pytest.mark.parametrize(("role", "flags", "says"), [
    ("prefill", ["--model", "/nonexistent/model-dir"],
     "pdserve prefill: model '/nonexistent/model-dir': model path /nonexistent/model-dir does not exist"),
    ("decode", ["--model", "smollm2-135m-instruc"],
     "pdserve decode: model 'smollm2-135m-instruc': unknown model 'smollm2-135m-instruc'; known models: smollm2"),
    ("decode", ["--device", "gpu"], "pdserve decode: --device 'gpu' is not a device name torch takes"),
    ("prefill", ["--device", "cuda:64"], "pdserve prefill: --device cuda:64: torch "),
    # an address that is not this machine's (TEST-NET-1): a traceback at bind before, for workers and serve
    ("decode", ["--device", "cpu", "--host", "192.0.2.1"], "pdserve decode: cannot listen on --host 192.0.2.1"),
    ("serve", ["--host", "192.0.2.1"], "pdserve serve: cannot listen on --host 192.0.2.1"),
])
def test_a_worker_given_a_model_or_device_it_cannot_use_exits_in_one_line(role: str, flags: list[str],
                                                                          says: str) -> None:
    """`pdserve prefill|decode` (how compose and Kubernetes start workers) given a --model that does not resolve,
    a --device torch cannot use or a --host it cannot listen on ends with the command's one-line error before
    anything loads, as `pdserve router` does, not a traceback; `pdserve serve` too for its --host."""
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", role, *flags], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(says), line


def test_a_router_given_a_worker_url_that_is_not_one_exits_in_one_line(default_model_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "router", "--prefill", "worker-1:8100"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == "pdserve router: worker URLs must be http(s) URLs, got 'worker-1:8100'", line
