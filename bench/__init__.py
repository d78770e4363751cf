"""`pdserve bench`: a load generator for any OpenAI-compatible server.

Life of a benchmark run:
  datasets / sharegpt  build `Conversation`s (one turn each, or several for multi-turn) with token counts;
  runner               releases conversations on a Poisson/gamma arrival schedule under a concurrency cap and
                       sends each turn (history included) through `client`, one streaming request at a time per
                       conversation;
  client               streams `/v1/completions` or `/v1/chat/completions` over httpx and timestamps every chunk
                       (TTFT, inter-token latencies, end-to-end latency);
  metrics              turns the recorded `RequestOutput`s into `BenchmarkMetrics` (names as `vllm bench serve`);
  report / plots       print the table, save JSON, draw latency CDFs and rate sweeps.
"""
