"""The router's relay ceiling on this machine: tokens per second one router process, on one core, hands from its
workers to 512 concurrent streaming clients, with workers that emit pre-made tokens as fast as it takes them.

    .venv/bin/python benchmarks/router_relay.py [--streams 512] [--max-tokens 256] [--seconds 15] \
        [--baseline-rev 6f59ec0] [--out benchmarks/results/router_relay_cpu.json]

Two paths in one run, each: the router (`pdserve router --prefill URL --decode URL`, as `pdserve serve` starts
it) pinned to core 0; one FAKE worker (benchmarks/relay_fakes.py, both roles) and the clients
(benchmarks/relay_clients.py) pinned to core 1.
  data_plane  this checkout: one multiplexed connection to the worker, one TOKENS message per step
  http        --baseline-rev (the commit before the data plane): per request a reserve, a prefill and one
              HTTP stream of frames, through httpx's pool; run from a git worktree of that commit
  data_plane_paced  this checkout, the fake's steps --paced-step-ms apart (a decode worker's pace): the router
              then reads one step at a time and writes every stream's token on its own, the regime of serving,
              where the unpaced run lets it read many steps at once and write each stream's tokens together
`relay_tokens_per_s` is the tokens the clients received in the measured window over its length; the router's
CPU seconds in the window over the window (1.0: its core was saturated, so the figure is the router's ceiling,
not the workers' or the clients').
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from pdserve.launch_plan import free_port

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "cache_store", "router", "prefill_node", "decode_node", "kv_transfer", "protocol")


def baseline_tree(rev: str, work: Path) -> Path:
    """A git worktree of `rev` and a folder that makes it importable as `pdserve` (PYTHONPATH): the installed
    editable pdserve is found after PYTHONPATH's entries."""
    tree = work / f"pdserve-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    shim = work / "shim" / "pdserve"
    shim.mkdir(parents=True)
    for entry in (tree / "pdserve").iterdir():
        (shim / entry.name).symlink_to(entry)
    for package in PACKAGES:
        if (tree / package).is_dir():
            (shim / package).symlink_to(tree / package)
    return shim.parent


def pinned(argv: list[str], cpu: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    # `python -m` puts the working directory first on sys.path: the baseline's, else this checkout's pdserve/
    cwd = env.get("PYTHONPATH", str(REPO))
    process = subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd)
    psutil.Process(process.pid).cpu_affinity([cpu])
    return process


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s: {log.read_text()[-2000:]}")


def run_path(mode: str, args: argparse.Namespace, env: dict[str, str], logs: Path) -> dict:
    pace = ["--step-ms", str(args.paced_step_ms)] if mode == "data_plane_paced" else []
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, load_cpu = cpus[0], cpus[-1]
    taken: set[int] = set()
    fake_port, router_port = free_port("127.0.0.1", taken), free_port("127.0.0.1", taken)
    fake_url, router_url = f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{router_port}"
    fake = pinned([sys.executable, str(REPO / "benchmarks/relay_fakes.py"), "--mode",
                   "http" if mode == "http" else "data", "--port", str(fake_port), "--secret", env["PDSERVE_SECRET"],
                   "--max-tokens", str(args.max_tokens), *pace], load_cpu, env, logs / f"{mode}-fake.log")
    extra = [] if mode == "http" else args.router_args.split()  # the baseline may not know today's flags
    router = pinned([sys.executable, "-m", "pdserve.cli", "router", "--port", str(router_port), "--prefill", fake_url,
                     "--decode", fake_url, *extra], router_cpu, env, logs / f"{mode}-router.log")
    try:
        wait_healthy(f"{fake_url}/internal/status", fake, logs / f"{mode}-fake.log")
        wait_healthy(f"{router_url}/health", router, logs / f"{mode}-router.log")
        clients = [sys.executable, str(REPO / "benchmarks/relay_clients.py"), "--url", router_url, "--streams",
                   str(args.streams), "--max-tokens", str(args.max_tokens), "--warmup", str(args.warmup), "--seconds",
                   str(args.seconds)]
        client = subprocess.Popen(clients, env=env, stdout=subprocess.PIPE, text=True)
        psutil.Process(client.pid).cpu_affinity([load_cpu])
        router_ps = psutil.Process(router.pid)
        time.sleep(args.warmup)
        before = router_ps.cpu_times()
        spy = None
        if args.py_spy is not None:  # where the router's time goes, in the window (py-spy's raw format)
            spy = subprocess.Popen(["py-spy", "record", "--format", "raw", "--pid", str(router.pid), "--duration",
                                    str(int(args.seconds)), "-o", str(args.py_spy / f"{mode}-router.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(args.seconds)
        after = router_ps.cpu_times()
        if spy is not None:
            spy.wait(timeout=60)
        out, _ = client.communicate(timeout=args.warmup + args.seconds + 120)
        result = json.loads(out.strip().splitlines()[-1])
        result["router_cpu_share"] = (after.user + after.system - before.user - before.system) / args.seconds
        return result
    finally:
        for process in (router, fake):
            process.terminate()
        for process in (router, fake):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--paced-step-ms", type=float, default=8.0,
                        help="the paced run's step interval (512 streams: 64k tokens/s offered at 8 ms)")
    parser.add_argument("--baseline-rev", default="6f59ec0", help="the per-request HTTP router (before the data "
                        "plane); empty: measure this checkout only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/router_relay_cpu.json")
    parser.add_argument("--py-spy", type=Path, default=None, help="a folder: record each router with py-spy")
    parser.add_argument("--router-args", default="", help="more flags for this checkout's router, e.g. "
                        "'--disable-log-requests' (no console line per finished request)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router_relay_"))
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_SECRET": "relay-benchmark-secret"}
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores, router on one",
                    "command": " ".join(sys.argv), "baseline_rev": args.baseline_rev, "load_before": os.getloadavg()[0],
                    "paths": {}}
    paths = {"data_plane": base_env, "data_plane_paced": base_env}
    if args.baseline_rev:
        paths["http"] = {**base_env, "PYTHONPATH": str(baseline_tree(args.baseline_rev, work))}
    try:
        for mode, env in paths.items():
            report["paths"][mode] = result = run_path(mode, args, env, work)
            print(f"{mode}: {result['relay_tokens_per_s']:.0f} tokens/s, {result['events_per_s']:.0f} events/s, "
                  f"router CPU {result['router_cpu_share']:.2f} of a core, {result['completed']} completed, "
                  f"{result['failed']} failed", flush=True)
    finally:
        if args.baseline_rev:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(work / f"pdserve-{args.baseline_rev}")], check=False, capture_output=True)
    report["relay_tokens_per_s"] = report["paths"]["data_plane"]["relay_tokens_per_s"]
    if "http" in report["paths"]:
        report["ratio_to_http"] = report["relay_tokens_per_s"] / max(report["paths"]["http"]["relay_tokens_per_s"], 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
