"""lm-eval's model interface over pdserve's offline engine (pdserve.llm.LLM): the reference that
benchmarks/lm_eval_local.py compares `pdserve serve` with.

Tokenization is lm-eval's own for API models (the Hugging Face tokenizer, no special tokens, a context's
trailing spaces moved into the continuation: TemplateLM._encode_pair), so both runs score the same token ids.
A request's log-likelihood is the sum of the continuation's prompt logprobs, and it is greedy when every
continuation token has rank 1: what local-completions reads from `echo` + `logprobs: 1` on the server
(the sum of token_logprobs[ctxlen:-1]; each token equal to its top-1).
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from transformers import PreTrainedTokenizerBase

from pdserve.engine.sampling import SamplingParams
from pdserve.llm import LLM

# what local-completions asks for: one generated token (discarded), the prompt's logprobs with their top-1
SCORING = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
Request = tuple[tuple[str, str], list[int], list[int]]  # (context, continuation), their token ids


class OfflineLM(TemplateLM):
    def __init__(self, llm: LLM, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        self.llm = llm
        self.tokenizer = tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # as local-completions: BOS if the tokenizer has one, else EOS (used only for an empty context)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: object) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

    def _loglikelihood_tokens(self, requests: list[Request], **kwargs: object) -> list[tuple[float, bool]]:
        prompts = [context + continuation for _, context, continuation in requests]
        outputs = self.llm.generate(prompts, SCORING)
        results = []
        for (_, context, _), output in zip(requests, outputs, strict=True):
            # prompt_logprobs[i]: token i given tokens < i (entry 0 is None); the continuation is [len(context):]
            entries = output.prompt_logprobs[len(context):]
            results.append((sum(e["logprob"] for e in entries), all(e["rank"] == 1 for e in entries)))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("OfflineLM scores loglikelihood and multiple_choice tasks only")

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("OfflineLM scores loglikelihood and multiple_choice tasks only")
