"""The router: pdserve's OpenAI-compatible front end. It owns tokenization, worker choice and the relay of
token streams; it never touches tensors: outside router/ it imports protocol/, engine.tokenizer, engine.chat,
engine.sampling_params (with engine.structured_output) and cache_store.hashing, nothing that runs a model
(tests/lint/test_import_boundaries.py).

Life of a request (modules in brackets):

    POST /v1/completions | /v1/chat/completions                                   [app, protocol]
      │  pydantic parses the body (bad JSON / types → 400, errors)
      ▼
    plan: model known? features supported? prompt → token ids (chat template),     [plan, prompts]
          prompt + max_tokens ≤ max_model_len? SamplingParams valid?
          → one SubRequest per choice (n × prompts; with a seed, choice i uses seed + i)
      ▼
    relay.start_all: for every SubRequest at once, all or none                    [relay, policies, registry]
          pick P (prefill policy) → reserve on D (decode policy; a full D answers 503: next D)
          → open D's frame stream ∥ POST prefill on P (P fails: abort both, once more with another P)
      ▼
    stream: SSE chunks per frame, [DONE]          or   collect: one JSON body      [streaming, responses, frames]
          (TTFT/ITL/TPOT/E2E timed per frame)                                      [metrics]
      ▼
    every DecodeStream closed: after its last frame, or early (client gone → D aborts and frees the blocks)

Workers register and heartbeat on /internal/workers/* or are listed statically and polled; the health
monitor drops silent ones [internal_routes, health]. All state lives in the app built by `create_app`.
"""
