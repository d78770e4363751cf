"""docs/configuration.md's "Coming from vLLM" table (pdserve/vllm_flags.py) names only flags `pdserve serve`
accepts, and covers the flags operators reach for first."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.commands.docs import hidden_pdserve_env
from pdserve.vllm_flags import VLLM_FLAGS
from tests.docs.markdown_blocks import REPO


def _serve_flags() -> set[str]:
    with hidden_pdserve_env():
        serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {flag for action in serve._actions for flag in action.option_strings}
    return flags | {a.metavar for a in serve._actions if not a.option_strings and isinstance(a.metavar, str)}


def test_every_pdserve_flag_in_the_table_exists() -> None:
    flags = _serve_flags()
    missing = [(row.vllm, flag) for row in VLLM_FLAGS for flag in row.pdserve if flag not in flags]
    assert not missing, f"pdserve/vllm_flags.py names flags `pdserve serve` lacks: {missing}"


def test_unsupported_rows_say_why_and_the_table_is_in_the_docs() -> None:
    assert all(row.note for row in VLLM_FLAGS if not row.pdserve)
    named = {part.strip() for row in VLLM_FLAGS for part in row.vllm.split(",")}
    for flag in ("--served-model-name", "--chat-template", "--enable-prefix-caching", "--seed", "--api-key",
                 "--allowed-origins", "--ssl-keyfile", "--tensor-parallel-size", "--disable-log-requests"):
        assert flag in named, flag
    assert "## Coming from vLLM" in (REPO / "docs" / "configuration.md").read_text()


