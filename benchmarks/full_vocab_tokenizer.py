"""A tokenizer for dummy weights that gives every token id text: word-level, token i is "t{i}" (decoded with a
space before it), for a model's whole vocabulary.

Why: dummy llama3-8b samples ids from 128,256 entries; the default model's tokenizer knows 49,152 of them, so
6 of 10 generated tokens decoded to nothing, sent no event, and made the stream look as if tokens came in twos
and threes (ITL p50 1.8x TPOT on the H200 with the default model's tokenizer, benchmarks/results/
serving_gpu_h200.json of 2026-12-02, first run). With this one every token is an event, as with real weights,
and the router relays every one of them. Prompts are still the ShareGPT texts, tokenized by the default model's
tokenizer and sent as token ids (all below 49,152, so valid ids here too).

    python benchmarks/full_vocab_tokenizer.py --vocab-size 128256 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "t0"  # the dummy model's EOS is never sampled by ignore_eos runs; it must name some entry


def write_tokenizer(vocab_size: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)  # joins pieces with spaces: "t5 t17"
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "unk_token": EOS}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_tokenizer(args.vocab_size, args.out))


if __name__ == "__main__":
    main()
