"""`vllm serve` flag → `pdserve serve` flag, for operators who know vLLM: the last section of
docs/configuration.md (pdserve/config_doc.py renders it). tests/docs/test_vllm_flags.py checks that every pdserve
flag named here is one `pdserve serve` accepts, so the table cannot promise a flag that is gone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmFlag:
    vllm: str
    pdserve: tuple[str, ...]  # empty: not supported
    note: str = ""


_ONE_DEVICE = "a worker runs on one device; scale out with more workers (`--num-prefill`, `--num-decode`)"

VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("MODEL (positional)", ("MODEL",), "`pdserve serve MODEL`, as `vllm serve MODEL`"),
    VllmFlag("--model", ("--model",), "also an embedded name (the default SmolLM2), a .gguf file, a directory"),
    VllmFlag("--revision", ("--revision",)),
    VllmFlag("--download-dir", ("--download-dir",), "a Hugging Face cache (the hub's layout)"),
    VllmFlag("--served-model-name", ("--served-model-name",)),
    VllmFlag("--tokenizer", ("--tokenizer",), "a local directory with tokenizer.json"),
    VllmFlag("--tokenizer-revision, --tokenizer-mode", (), "the tokenizer is the model's, or a local directory"),
    VllmFlag("--trust-remote-code", (), "no model code is downloaded: Llama, Mistral and Qwen2 are built in"),
    VllmFlag("--chat-template", ("--chat-template",), "a file, or the template itself on one line"),
    VllmFlag("--load-format", ("--load-format",), "auto, gguf, hf, dummy"),
    VllmFlag("--dtype", ("--dtype",), "auto, float32, float16, bfloat16"),
    VllmFlag("--max-model-len", ("--max-model-len",)),
    VllmFlag("--seed", ("--seed",)),
    VllmFlag("--host, --port", ("--host", "--port")),
    VllmFlag("--api-key", ("--api-key",), "or PDSERVE_API_KEY, which `ps` does not show"),
    VllmFlag("--uvicorn-log-level", ("--log-level",), "pdserve's own log lines too"),
    VllmFlag("--disable-log-requests", ("--disable-log-requests",), "the router's line per finished request"),
    VllmFlag("--disable-log-stats", ("--disable-log-stats",),
             "the router's stats line per pool; its interval: `--log-stats-interval` (vLLM: VLLM_LOG_STATS_INTERVAL)"),
    VllmFlag("--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials",
             ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials"),
             "no CORS unless origins are given (vLLM allows any origin by default)"),
    VllmFlag("--ssl-keyfile, --ssl-certfile", ("--ssl-keyfile", "--ssl-certfile")),
    VllmFlag("--ssl-ca-certs, --ssl-cert-reqs", (), "no client certificates: terminate mutual TLS in a proxy"),
    VllmFlag("--gpu-memory-utilization", ("--gpu-memory-utilization",), "per worker, weights included"),
    VllmFlag("--block-size", ("--block-size",)),
    VllmFlag("--enable-prefix-caching, --no-enable-prefix-caching",
             ("--enable-prefix-caching", "--no-enable-prefix-caching"), "on by default, as in vLLM"),
    VllmFlag("--max-num-seqs", ("--max-num-seqs",)),
    VllmFlag("--max-num-batched-tokens", ("--max-num-batched-tokens",)),
    VllmFlag("--enable-chunked-prefill", (), "always on: prompts beyond --max-num-batched-tokens are chunked"),
    VllmFlag("--enforce-eager", ("--enforce-eager",)),
    VllmFlag("--swap-space", ("--host-cache-gb",), "a host-RAM prefix-cache tier, not swap space for preemption"),
    VllmFlag("--kv-transfer-config", ("--transfer-backend",), "prefill/decode disaggregation is built in"),
    VllmFlag("--data-parallel-size", ("--num-colocated",), "with --colocated: that many full replicas"),
    VllmFlag("--tensor-parallel-size, --pipeline-parallel-size", (), _ONE_DEVICE),
    VllmFlag("--quantization", ("--quantization",),
             "fp8 (W8A8: weights per channel, activations per token, dynamic) or none; FP8 checkpoints load as "
             "stored; GGUF files are dequantised once at load"),
    VllmFlag("--kv-cache-dtype", ("--kv-cache-dtype",), "auto, fp8 or fp8_e4m3 (the same e4m3 cache); fp8_e5m2 is not supported"),
    VllmFlag("--calculate-kv-scales", ("--calculate-kv-scales",),
             "computed once at start from a built-in text, not from the first batch: every worker gets the same"),
    VllmFlag("--cpu-offload-gb", (), "weights stay on the worker's device"),
    VllmFlag("--enable-lora, --lora-modules", (), "no adapters"),
    VllmFlag("--speculative-config", (), "no speculative decoding"),
    VllmFlag("--enable-auto-tool-choice, --tool-call-parser", (), "requests with `tools` get 400"),
    VllmFlag("--generation-config", (), "the model's generation_config.json gives the stop tokens only"),
    VllmFlag("--root-path, --middleware, --disable-fastapi-docs", (), "put a proxy in front of the router"),
)


def render_vllm_table() -> list[str]:
    lines = ["## Coming from vLLM", "",
             ("`vllm serve` flags and what `pdserve serve` takes instead (every pdserve flag here is checked "
             "against the parser by tests/docs/test_vllm_flags.py)."), "",
             "| `vllm serve` | `pdserve serve` | note |", "|---|---|---|"]
    for row in VLLM_FLAGS:
        ours = ", ".join(f"`{flag}`" for flag in row.pdserve) if row.pdserve else "not supported"
        lines.append(f"| `{row.vllm}` | {ours} | {row.note} |")
    return lines + [""]
