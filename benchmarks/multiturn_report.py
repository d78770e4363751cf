"""benchmarks/multiturn_reuse.py's comparison of its rows and its closing table (imported by it; run as a script
from the repository root, the scripts' folder is on sys.path)."""

from __future__ import annotations


def compare(report: dict) -> None:
    """Each row against the baseline (`today` when it ran, else the first row): greedy texts equal, turns >= 2
    TTFT p50 speedup, throughput ratio; and the engine-bound share of each row's throughput when measured."""
    rows = report["rows"]
    if not rows:
        return
    base_name = "today" if "today" in rows else next(iter(rows))
    base = rows[base_name]
    bound = report.get("engine_bound")
    for row in rows.values():
        pairs = [(a, b) for ca, cb in zip(base["texts"], row["texts"]) for a, b in zip(ca, cb)]
        row["texts_equal_to_" + base_name] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        if base["later_turns_ttft_p50_ms"] and row["later_turns_ttft_p50_ms"]:
            row["later_turns_ttft_p50_speedup_vs_" + base_name] = (base["later_turns_ttft_p50_ms"]
                                                                   / row["later_turns_ttft_p50_ms"])
        row["throughput_ratio_vs_" + base_name] = row["output_tok_per_s"] / base["output_tok_per_s"]
        if bound is not None:
            row["ratio_to_engine_bound"] = row["output_tok_per_s"] / bound["output_tok_s"]


def _speedup(row: dict) -> float:
    return next((v for k, v in row.items() if k.startswith("later_turns_ttft_p50_speedup_vs_")), 1.0)


def table(report: dict) -> str:
    header = (f"{'row':8} {'turn':>4} {'TTFT p50 ms':>11} {'p90 ms':>7} {'P->D MiB':>9} {'bound MiB':>9} "
              f"{'history':>7} {'D reuse':>7} {'local':>5} {'P tok':>7}")
    lines = [header]
    for name, row in report["rows"].items():
        for k, t in enumerate(row["turns"]):
            lines.append(f"{name:8} {k + 1:>4} {t['ttft_p50_ms']:>11.0f} {t['ttft_p90_ms']:>7.0f} "
                         f"{t['bytes_p_to_d'] / 2**20:>9.1f} {t['new_turn_bytes'] / 2**20:>9.1f} "
                         f"{t['history_share']:>7.0%} {t['d_reuse_ratio']:>7.0%} {t['local_prefills']:>5.0f} "
                         f"{t['p_computed_tokens']:>7.0f}")
        within = "yes" if row["later_turns_within_new_turn_bytes"] else "no"
        lines.append(f"{name:8} all: {row['output_tok_per_s']:.1f} out tok/s, {row['requests_per_s']:.2f} req/s, "
                     f"turns >= 2 TTFT p50 {row['later_turns_ttft_p50_ms'] or 0:.0f} ms ({_speedup(row):.2f}x), "
                     f"P->D within the new turns' blocks: {within}")
    bound = report.get("engine_bound")
    if bound is not None:
        lines.append(f"engine-bound: {bound['output_tok_s']:.0f} out tok/s over the same waves")
    return "\n".join(lines)
