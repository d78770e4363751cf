"""Router configuration: one frozen dataclass, validated on construction. The CLI builds it from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.policies import DECODE_POLICIES, PREFILL_POLICIES, PolicyOptions


@dataclass(frozen=True)
class RouterConfig:
    """What the router serves and how it reaches workers.

    model: the served model name, the only `model` value requests may name (others get 404).
    prefill_urls / decode_urls: static workers, polled at `poll_interval_s` (no registration needed).
    heartbeat_timeout_s: a registered worker silent this long is dropped (None: 3 × heartbeat_interval_s).
    secret: when set, every /internal/* call must carry `X-PDServe-Secret: <secret>`.
    admin_token: when set, /admin/* answers requests with `Authorization: Bearer <admin_token>`; when None the
        admin API is off (every call gets 403).
    api_key / max_body_bytes / max_inflight_requests: the front door of /v1/* (router/front_door.py).
    status_window_s: the latency percentiles of /status cover finished requests of this many last seconds.
    log_requests: one INFO line per finished request (router/console.py; off: --disable-log-requests).
    log_stats / log_stats_interval_s: a stats line per pool every this many seconds while busy (off:
        --disable-log-stats).
    """

    model: str
    max_model_len: int = 8192
    block_size: int = 16
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    prefill_policy: str = "cache_aware"
    cache_aware_max_imbalance: int = 4  # cache_aware: queued requests beyond the least loaded P it accepts
    decode_policy: str = "least_kv"
    # conditional disaggregation (router/decode_reuse.py): a request whose uncached suffix on a decode worker
    # holding part of it is shorter than this many tokens is prefilled by that worker (no P, no transfer); 0: never.
    # 256: on the H200 a 4,096-token prefill of llama3-8b took 104 ms (BENCHMARKS.md), so 256 tokens take ~6.5 ms,
    # about one decode step of a 64-sequence batch at 512 tokens of context (6.5 ms): a local prefill under it
    # stalls D's running batch for about one step
    local_prefill_threshold: int = 256
    # ... and when the prefill pool lost a worker and no P left can take a prompt soon: a fresh prompt shorter than
    # busy_local_prefill_tokens is prefilled by a decode worker when fewer Ps are reachable than registered and each
    # one left already has busy_prefill_backlog prompt tokens or more in prefill (the router's own count, current
    # to the request), or none is reachable; 0: never. A whole pool that is merely busy keeps its prompts. The
    # backlog default is one forward of a P at its default --max-num-batched-tokens (2,048): below it the prompt
    # would join P's next forward; at or above it, it waits a whole forward at least
    busy_local_prefill_tokens: int = 256
    busy_prefill_backlog: int = 2048
    secret: str | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float | None = None
    poll_interval_s: float = 1.0
    connect_timeout_s: float = 2.0
    control_timeout_s: float = 10.0  # static workers' status polls
    # a reservation is answered in milliseconds (a colocated worker's host / Redis lookup: --cache-timeout);
    # a D silent this long is marked unreachable and the next D is asked (issue 16: a frozen D costs seconds)
    reserve_timeout_s: float = 2.0
    # a data-plane link silent this long (no message, not even the pong of a ping sent every quarter of it)
    # is a stalled worker: its requests end with an error (or are retried before their first token), the link
    # is closed (the worker, once it runs again, frees what it held) and it takes no new work until it
    # heartbeats again. Decode steps run on their own thread, so even a long one leaves the worker's event loop
    # free to answer pings: 4 s is ~400 H200 steps and ~25 of the CPU default model's. The same limit applies to
    # the step threads themselves (router/health.py): a worker whose steps made no progress for it (its
    # heartbeats' step_stalled_s: a tick per layer, decode step or idle turn) is stalled
    stream_stall_timeout_s: float = 4.0
    prefill_timeout_s: float = 600.0  # a long prompt on a CPU worker takes minutes
    stream_idle_timeout_s: float = 600.0  # longest silence on a D stream (it waits for the prefill first)
    max_connections: int = 1024
    retry_after_s: int = 1
    max_n: int = 128
    # what n multiplies, summed over a request's choices (n x every prompt): prompt tokens to prefill and
    # completion tokens to decode; the default is 128 choices of 2,048 tokens each. No flag: set in RouterConfig
    max_request_prompt_tokens: int = 262_144
    max_request_completion_tokens: int = 262_144
    extra_models: tuple[str, ...] = field(default_factory=tuple)  # aliases accepted as `model`
    admin_token: str | None = None
    status_window_s: float = 300.0
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>` (router/front_door.py)
    max_body_bytes: int = 32 << 20  # larger request bodies get 413
    max_inflight_requests: int = 1024  # completions being answered at once; more get 429 + Retry-After
    log_requests: bool = True
    log_stats: bool = True
    log_stats_interval_s: float = 10.0  # vLLM's interval (its VLLM_LOG_STATS_INTERVAL)
    tool_call_parser: str = "hermes"  # how `tool_choice: auto` output is read (router/tool_parser.py)

    def __post_init__(self) -> None:
        if not self.model or not all(self.extra_models):
            raise ValueError(f"served model names must not be empty, got {[self.model, *self.extra_models]}")
        if self.block_size & (self.block_size - 1):  # what every worker's pool takes (pdserve/settings.py)
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        for name in ("max_model_len", "block_size", "max_connections", "max_n", "max_body_bytes",
                     "max_inflight_requests", "max_request_prompt_tokens", "max_request_completion_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "poll_interval_s", "connect_timeout_s", "control_timeout_s",
                     "reserve_timeout_s", "stream_stall_timeout_s", "prefill_timeout_s", "stream_idle_timeout_s",
                     "status_window_s", "log_stats_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {self.prefill_policy!r}; choose one of {sorted(PREFILL_POLICIES)}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"unknown decode policy {self.decode_policy!r}; choose one of {sorted(DECODE_POLICIES)}")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URLs must be http(s) URLs, got {url!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no API key)")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError(f"admin_token must be at least 8 characters, got {len(self.admin_token)}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.busy_local_prefill_tokens < 0 or self.busy_prefill_backlog < 1:
            raise ValueError(f"busy_local_prefill_tokens must be >= 0 and busy_prefill_backlog >= 1, got "
                             f"{self.busy_local_prefill_tokens} and {self.busy_prefill_backlog}")
        if self.cache_aware_max_imbalance < 0:
            raise ValueError(f"cache_aware_max_imbalance must be >= 0, got {self.cache_aware_max_imbalance}")
        if self.tool_call_parser not in ("hermes",):
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; choose one of ['hermes']")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

    @property
    def worker_timeout_s(self) -> float:
        """Seconds without a heartbeat after which a registered worker is dropped."""
        return self.heartbeat_timeout_s if self.heartbeat_timeout_s is not None else 3 * self.heartbeat_interval_s

    @property
    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(self.block_size, self.cache_aware_max_imbalance)

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.model, *self.extra_models)
