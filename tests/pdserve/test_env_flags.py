"""PDSERVE_<FLAG> environment defaults of the router / prefill / decode commands (pdserve/env_flags.py)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.env_flags import apply_env_defaults, env_name
from pdserve.settings import parse_size
from pdserve.worker.flags import add_worker_arguments


def worker_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="decode")
    apply_env_defaults(parser, environ)
    return parser


def test_environment_sets_defaults_and_flags_still_win() -> None:
    env = {"PDSERVE_PORT": "8100", "PDSERVE_ROLE": "both", "PDSERVE_KV_CACHE_MEMORY": "2GiB",
           "PDSERVE_ROUTER": "http://router:8000", "PDSERVE_TORCH_THREADS": "", "UNRELATED": "1"}
    args = worker_parser(env).parse_args([])
    assert (args.port, args.role, args.router) == (8100, "both", "http://router:8000")
    assert args.kv_cache_memory == parse_size("2GiB") and args.torch_threads is None  # empty: unset
    assert worker_parser(env).parse_args(["--port", "9000", "--role", "prefill"]).port == 9000


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(SystemExit, match=r"PDSERVE_ROLE='router' is not a valid --role: choose one of"):
        worker_parser({"PDSERVE_ROLE": "router"})
    with pytest.raises(SystemExit, match="PDSERVE_PORT='eighty'"):
        worker_parser({"PDSERVE_PORT": "eighty"})


def test_lists_and_switches() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", action="append", default=[])
    parser.add_argument("--colocated", action="store_true")
    taken = apply_env_defaults(parser, {"PDSERVE_DECODE": "http://a:1, http://b:2", "PDSERVE_COLOCATED": "yes"})
    args = parser.parse_args([])
    assert args.decode == ["http://a:1", "http://b:2"] and args.colocated is True
    assert taken == {"decode": ["http://a:1", "http://b:2"], "colocated": True}
    with pytest.raises(SystemExit, match="PDSERVE_COLOCATED"):
        apply_env_defaults(parser, {"PDSERVE_COLOCATED": "maybe"})


def test_help_names_each_variable() -> None:
    text = worker_parser({}).format_help()
    for var in ("PDSERVE_ADVERTISE_HOST", "PDSERVE_ROUTER", "PDSERVE_NUM_BLOCKS", "PDSERVE_DEVICE"):
        assert var in text
    assert env_name("max_num_seqs") == "PDSERVE_MAX_NUM_SEQS"
