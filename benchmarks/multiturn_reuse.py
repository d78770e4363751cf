"""Multi-turn reuse on the decode side (issue 22): ShareGPT conversations, turn by turn, against each path, in one run.

    .venv/bin/python benchmarks/multiturn_reuse.py                 # CPU, default model (~5 min on 2 cores)
    python benchmarks/multiturn_reuse.py --gpu --tokenizer DIR     # H200, dummy llama3-8b bf16: multiturn_reuse_h200.sh
    ... [--rows today dcache local] [--transfer-backend auto|tcp|cuda_ipc|nccl] [--out PATH]
    pdserve bench --dataset-name multiturn --dataset-path SHAREGPT ...   the same data set against any one server

Rows, each one `pdserve serve` deployment (router + 1 P + 1 D, started by the launcher as a user starts it:
serving_common.Deployment) in turn on the same conversations:
    today    --no-decode-prefix-cache --local-prefill-threshold 0: D takes new blocks for every prompt, P sends it
             whole (P still finds the history in its own prefix cache and computes only the new part)
    dcache   --local-prefill-threshold 0: D's reservation takes the history it holds, P sends only the rest (delta)
    local    the defaults: dcache + conditional disaggregation (a suffix under 256 tokens is prefilled on D, no P)
    store    today's path with KV through the transfer store (`--transfer-backend store`: shm on one host); a row
             is one entry of ROWS, so a combination (dcache + store) is one more line
--transfer-backend goes to every row (a row's own --transfer-backend wins).

Workload: --conversations ShareGPT conversations of >= 2 exchanges (`pdserve bench`'s multi-turn sampler over the
shared data set, so turns >= 2 are the data set's later human turns), at most --turns each. Every human message is
tokenized by the default model's tokenizer and sent as token ids to /v1/completions (dummy weights have no chat
template): turn k's prompt = turn k-1's prompt + the ids the model answered + "\n\n" + the k-th message;
max_tokens = the data set's answer length, at most --max-output-len, ignore_eos, greedy.
The history carries the model's own replies, not the data set's assistant turns: that is what a chat client sends
back, and it is the only history D can hold (D keeps the KV of what it generated; a data set answer in its place
would end the reuse at the previous prompt on every path). The deployments detokenize with a word-level tokenizer
over the model's whole vocabulary (benchmarks/full_vocab_tokenizer.py: token i is " t{i}"), so an answer's text
gives back exactly the ids generated (a real client's re-tokenized history can differ at some token; the reuse
would then end there, on every row alike).
Turns go in waves: every conversation's turn k at once (at most --max-concurrency in flight), each sent once that
conversation's turn k-1 is answered, turn k+1 once all of turn k is; the workers' Prometheus counters are read
around each wave, which is what attributes P's bytes to a turn index (no per-request byte count exists).
Per row and turn: TTFT p50 / p90 / mean (computed as `pdserve bench` computes its ttft_by_turn), bytes P -> D (P's
pdserve_prefill_transfer_bytes) beside the bound "the new turn's blocks" (prompt blocks after the full blocks the
previous turn left with KV on D: prompt + answer but its last token), D's reuse, local prefills, P's computed
tokens, D's decode steps (mean batch, wall and CPU ms: on a shared CPU the gap is time spent waiting for a core).
Per row: output tokens / s and requests / s over all waves, turns >= 2 TTFT p50 and its speedup over today's path;
with --gpu the engine-bound output tok/s for the same waves (benchmarks/engine_bound.py: the engine's own step
times, measured in this run, prefilling only what no cache holds). Greedy texts are compared with today's path's.
Results: --out (JSON, the command line inside), a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
from full_vocab_tokenizer import write_tokenizer
from multiturn_chats import Chat, TurnBound, conversations
from multiturn_report import compare, table
from serving_common import Deployment, decode_counters, machine_load, step_summary, wait_for_quiet

from pdserve.bench.client import ApiTarget, RequestOutput, send_request
from pdserve.bench.metrics import MetricStats, compute_metrics
from pdserve.bench.tokenizer import CountingTokenizer, load_tokenizer
from pdserve.engine.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
ROWS = {"today": ["--no-decode-prefix-cache", "--local-prefill-threshold", "0"],
        "dcache": ["--local-prefill-threshold", "0"],
        "local": []}
ROWS["store"] = [*ROWS["today"], "--transfer-backend", "store"]  # today's path, KV through the transfer store
COUNTERS = {"prefill": ("pdserve_prefill_transfer_bytes", "pdserve_prefill_computed_tokens",
                        "pdserve_prefill_cached_tokens"),
            "decode": ("pdserve_decode_reused_prompt_tokens", "pdserve_decode_local_prefills",
                       "pdserve_decode_local_prefill_tokens", "pdserve_decode_generated_tokens"),
            "router": ("pdserve_local_prefills", "pdserve_local_prefill_fallbacks")}
PERCENTILES = [50.0, 90.0]


def read_counters(dep: Deployment, urls: dict[str, str]) -> dict[str, float]:
    out = {}
    for role, url in urls.items():
        text = httpx.get(f"{url}/metrics", headers=dep.headers, timeout=10).text
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.removesuffix("_total") in COUNTERS[role]:
                out[name.removesuffix("_total")] = float(value)
    return out


async def wave(http: httpx.AsyncClient, target: ApiTarget, chats: list[Chat], k: int, sep: list[int],
               answer_tokenizer: CountingTokenizer, limit: asyncio.Semaphore) -> list[RequestOutput]:
    """Every conversation's turn k at once (at most `limit` in flight); answers recorded for turn k + 1."""
    async def one(chat: Chat) -> RequestOutput:
        prompt = chat.prompt(k, sep)
        async with limit:
            out = await send_request(http, target, prompt, chat.max_tokens[k], len(prompt), time.perf_counter())
        chat.prompts.append(prompt)
        chat.answers.append(answer_tokenizer.encode(out.generated_text, add_special_tokens=False))
        chat.texts.append(out.generated_text)
        return replace(out, turn=k)

    return await asyncio.gather(*(one(c) for c in chats if len(c.messages) > k))


def turn_summary(outs: list[RequestOutput], before: dict[str, float], after: dict[str, float], seconds: float,
                 bound: TurnBound, block_bytes: int) -> dict:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ttft_s = sorted(o.ttft for o in outs if o.success)
    stats = MetricStats.of(ttft_s, PERCENTILES)  # as `pdserve bench` computes them (ttft_by_turn)
    sent = delta("pdserve_prefill_transfer_bytes")
    return {"requests": len(outs), "failed": sum(not o.success for o in outs), "seconds": seconds,
            "ttft_p50_ms": stats.median_ms, "ttft_p90_ms": dict(stats.percentiles_ms)[90.0],
            "ttft_mean_ms": stats.mean_ms, "ttft_ms": [1000 * t for t in ttft_s],
            "prompt_tokens": bound.prompt_tokens, "output_tokens": sum(o.output_len for o in outs),
            "history_share": bound.held_tokens / max(bound.prompt_tokens, 1),
            "bytes_p_to_d": sent, "bytes_p_to_d_per_request": sent / max(len(outs), 1),
            "new_turn_blocks": bound.new_blocks, "new_turn_bytes": bound.new_blocks * block_bytes,
            "within_new_turn_bytes": sent <= bound.new_blocks * block_bytes,
            "d_reused_tokens": delta("pdserve_decode_reused_prompt_tokens"),
            "d_reuse_ratio": delta("pdserve_decode_reused_prompt_tokens") / max(bound.prompt_tokens, 1),
            "p_computed_tokens": delta("pdserve_prefill_computed_tokens"),
            "p_cached_tokens": delta("pdserve_prefill_cached_tokens"),
            "local_prefills": delta("pdserve_decode_local_prefills"),
            "local_prefill_tokens": delta("pdserve_decode_local_prefill_tokens"),
            "router_local_prefills": delta("pdserve_local_prefills"),
            "router_local_fallbacks": delta("pdserve_local_prefill_fallbacks"),
            "errors": [o.error for o in outs if not o.success][:3]}


async def drive(dep: Deployment, chats: list[Chat], args: argparse.Namespace, sep: list[int],
                answer_tokenizer: CountingTokenizer) -> tuple[list[dict], list[RequestOutput]]:
    workers = dep.workers()
    urls = {"prefill": next(w["url"] for w in workers if "prefill" in w["roles"]),
            "decode": next(w["url"] for w in workers if "decode" in w["roles"]), "router": dep.url}
    target = ApiTarget(dep.url, model=dep.model(), ignore_eos=True, temperature=0.0)
    limit = asyncio.Semaphore(args.max_concurrency or len(chats))
    turns, outputs = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=None)) as http:
        await warm_up(http, target, answer_tokenizer)
        for k in range(max(len(c.messages) for c in chats)):
            before, steps_before = read_counters(dep, urls), decode_counters(urls["decode"])
            started = time.perf_counter()
            outs = await wave(http, target, chats, k, sep, answer_tokenizer, limit)
            seconds = time.perf_counter() - started
            await asyncio.sleep(0.2)  # counters of the last frames
            after = read_counters(dep, urls)
            turns.append(turn_summary(outs, before, after, seconds, TurnBound.of(chats, k, args.block_size),
                                      args.block_bytes))
            turns[-1]["decode_steps"] = step_summary(steps_before, decode_counters(urls["decode"]))
            outputs += outs
            print(f"  turn {k + 1}: {_line(turns[-1])}", flush=True)
    return turns, outputs


async def warm_up(http: httpx.AsyncClient, target: ApiTarget, answer_tokenizer: CountingTokenizer) -> None:
    """Connections and first-use costs of each path (not measured): 8 two-turn chats of token ids no conversation
    shares, so that the second turns take the row's own path (a delta, or a local prefill on D) once before."""
    async def chat(i: int) -> None:
        prompt = [7 + (i * 31 + j * 17) % 500 for j in range(48)]
        out = await send_request(http, target, prompt, 8, len(prompt), time.perf_counter())
        follow = prompt + answer_tokenizer.encode(out.generated_text, add_special_tokens=False) + prompt[:24]
        await send_request(http, target, follow, 8, len(follow), time.perf_counter())

    await asyncio.gather(*(chat(i) for i in range(8)))


def _line(t: dict) -> str:
    return (f"{t['requests']} req, TTFT p50 {t['ttft_p50_ms']:.0f} ms, P->D {t['bytes_p_to_d'] / 2**20:.1f} MiB "
            f"(new-turn bound {t['new_turn_bytes'] / 2**20:.1f}), D reuse {t['d_reuse_ratio']:.0%}, "
            f"local {t['local_prefills']:.0f}, P computed {t['p_computed_tokens']:.0f} tok, "
            f"decode step {t['decode_steps']['step_ms']:.0f} ms at batch {t['decode_steps']['mean_batch']:.1f}")


def run_row(name: str, args: argparse.Namespace, counting: CountingTokenizer, answer_tokenizer: CountingTokenizer,
            logs: Path) -> tuple[dict, list[Chat]]:
    chats = conversations(args.sharegpt, counting, args.conversations, args.seed, args.turns,
                          args.max_context, args.max_output_len)
    flags = [*args.deployment_flags, "--transfer-backend", args.transfer_backend, *ROWS[name]]
    print(f"{name}: pdserve serve {' '.join(flags)}", flush=True)
    load_before = wait_for_quiet(args.max_load, 600) if args.max_load else machine_load()
    t0 = time.monotonic()
    with Deployment(args.port, flags, logs / f"{name}.log") as dep:
        ready_s = time.monotonic() - t0
        turns, outputs = asyncio.run(drive(dep, chats, args, counting.encode("\n\n", add_special_tokens=False),
                                           answer_tokenizer))
    seconds = sum(t["seconds"] for t in turns)
    metrics = compute_metrics(outputs, seconds, percentiles=PERCENTILES)  # `pdserve bench`'s, over all waves
    later = [o.ttft for o in outputs if o.success and o.turn > 0]
    return {"flags": flags, "ready_s": ready_s, "load_before": load_before, "load_after": machine_load(),
            "turns": turns, "seconds": seconds, "metrics": metrics.to_dict(("ttft", "tpot", "e2el")),
            "output_tok_per_s": metrics.output_throughput, "requests_per_s": metrics.request_throughput,
            "later_turns_ttft_p50_ms": 1000 * statistics.median(later) if later else None,
            "later_turns_within_new_turn_bytes": all(t["within_new_turn_bytes"] for t in turns[1:]),
            "texts": [c.texts for c in chats]}, chats


def engine_bound(chats: list[Chat], args: argparse.Namespace, preset: str, logs: Path) -> dict:
    """The engine alone over the same waves: each wave all at once, prefilling only the tokens no cache holds
    (every row's P or D finds the previous turns' full blocks), decoding max_tokens each."""
    from engine_bound import measure_in_subprocess, replay

    table_ = measure_in_subprocess(preset, logs / "engine_table.json")
    duration = tokens = 0.0
    for k in range(max(len(c.messages) for c in chats)):
        sent = [c for c in chats if len(c.prompts) > k]
        lengths = [(len(c.prompts[k]), c.max_tokens[k]) for c in sent]
        bound = replay(lengths, table_, max_num_seqs=256, cached=[c.held_tokens(k, args.block_size) for c in sent])
        duration, tokens = duration + bound["duration_s"], tokens + bound["output_tokens"]
    return {"output_tok_s": tokens / duration, "duration_s": duration, "output_tokens": tokens,
            "engine_table": table_.to_dict()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the H200 setup: dummy llama3-8b bf16, a full-vocabulary "
                        "tokenizer, 64 conversations, answers up to 256 tokens (~90%% of turns >= 2 is history)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="the paths compared, one deployment each (store: where the launcher has it)")
    parser.add_argument("--transfer-backend", default="auto", help="given to every row's pdserve serve")
    parser.add_argument("--sharegpt", type=Path, default=REPO.parent / "shared/data/sharegpt_v3_sample2k.json.gz")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a directory with tokenizer.json that encodes the messages (default: the default "
                             "model's, from the model cache)")
    parser.add_argument("--conversations", type=int, default=None, help="default 8 (CPU), 64 (--gpu)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation at most")
    parser.add_argument("--max-context", type=int, default=None, help="tokens of history, default 2048 / 3072")
    parser.add_argument("--max-output-len", type=int, default=None, help="answer tokens at most, default 48 / 256")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight per wave (all)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8751)
    parser.add_argument("--worker-flags", default="", help="more pdserve serve flags, one string")
    parser.add_argument("--no-engine-bound", action="store_true", help="skip the engine-bound figure (--gpu)")
    parser.add_argument("--max-load", type=float, default=None,
                        help="wait (up to 10 min) for the 1-minute load average to drop to this before each row")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/multiturn_reuse_{cpu,h200}.json")
    parser.add_argument("--logs", type=Path, default=None, help="the deployments' logs (default: a new temp dir)")
    args = parser.parse_args()
    gpu = args.gpu
    args.conversations = args.conversations or (64 if gpu else 8)
    args.max_context = args.max_context or (3072 if gpu else 2048)
    args.max_output_len = args.max_output_len or (256 if gpu else 48)
    args.out = args.out or REPO / f"benchmarks/results/multiturn_reuse_{'h200' if gpu else 'cpu'}.json"
    return args


def main() -> int:
    args = parse_args()
    # a `timeout`'s SIGTERM unwinds like Ctrl-C: the deployment running then is stopped (its GPU memory freed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="multiturn_reuse_"))
    logs.mkdir(parents=True, exist_ok=True)
    counting = load_tokenizer(str(args.tokenizer)) if args.tokenizer else default_tokenizer()
    preset = "llama3-8b" if args.gpu else "smollm2-135m"
    config = get_preset(preset)  # the CPU's default model has the smollm2-135m preset's shapes
    args.block_bytes = config.num_layers * 2 * args.block_size * config.num_kv_heads * config.head_dim * (
        2 if args.gpu else 4)  # K and V of every layer: bf16 on the GPU, fp32 on a CPU
    vocab = write_tokenizer(config.vocab_size, logs / "tokenizer")
    answer_tokenizer = load_tokenizer(str(vocab))
    args.deployment_flags = [*args.worker_flags.split(), "--tokenizer", str(vocab)]
    if args.gpu:
        args.deployment_flags += ["--load-format", "dummy", "--model-preset", preset, "--max-model-len", "4096"]
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
                    "device": "H200 (--gpu)" if args.gpu else "CPU", "block_bytes": args.block_bytes,
                    "workload": _workload(args), "rows": {}}
    for name in args.rows:
        report["rows"][name], chats = run_row(name, args, counting, answer_tokenizer, logs)
        if args.gpu and not args.no_engine_bound and "engine_bound" not in report:
            report["engine_bound"] = engine_bound(chats, args, preset, logs)
        compare(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"saved {args.out}; logs in {logs}")
    failed = sum(t["failed"] for row in report["rows"].values() for t in row["turns"])
    return 1 if failed else 0


def _workload(args: argparse.Namespace) -> dict:
    return {"sharegpt": str(args.sharegpt), "conversations": args.conversations, "turns": args.turns,
            "max_context": args.max_context, "max_output_len": args.max_output_len,
            "max_concurrency": args.max_concurrency, "transfer_backend": args.transfer_backend,
            "ignore_eos": True, "endpoint": "/v1/completions (token ids)", "seed": args.seed,
            "history": "the model's own replies (ids as generated), not the data set's assistant turns"}


def default_tokenizer() -> CountingTokenizer:
    import os

    from pdserve.engine.weights.locate import load_tokenizer as load_model_tokenizer
    from pdserve.settings import DEFAULT_MODEL

    return load_model_tokenizer(DEFAULT_MODEL, os.environ.get("PDSERVE_CACHE_DIR"), progress=True)


if __name__ == "__main__":
    raise SystemExit(main())
