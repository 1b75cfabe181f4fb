"""Train a sentencepiece tokenizer: `python -m tokenizer.train --input PATH ... --output-prefix OUT
--vocab-size N [--model-type {bpe,unigram,char}]` writes OUT.model and OUT.vocab.

Settings follow what LLM tokenizers use: byte fallback (no unknown characters), digits split, and
no normalization or whitespace collapsing, so decode(encode(text)) == text for any text. Ids are
fixed: unk=0, bos=1, eos=2 (also the end-of-document token), pad=3. Inputs larger than memory
are reservoir-sampled to --input-sentence-size lines before training.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from tokenizer.corpus import expand_inputs, iter_texts
from tokenizer.tokenizer import Tokenizer, TokenizerError

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
MAX_LINE_BYTES = 4192  # sentencepiece's max_sentence_length; longer lines are cut to fit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenizer.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="text / JSONL files or directories (.gz accepted)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char"])
    p.add_argument("--json-keys", default="text", help="field holding the text in JSONL inputs")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="lines sampled (reservoir, seeded) from the inputs for training")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters covered by pieces; rarer ones use byte fallback")
    p.add_argument("--seed", type=int, default=0, help="seed of the input sample")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--debug", action="store_true", help="show the Python traceback of a user "
                   "mistake too (MEGATRON_LITE_DEBUG=1)")
    return p.parse_args(argv)


def iter_lines(texts: Iterable[str]) -> Iterator[str]:
    """Training sentences: non-blank lines, cut to sentencepiece's length limit."""
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            while len(line.encode("utf-8")) > MAX_LINE_BYTES:
                yield line[:MAX_LINE_BYTES // 4]
                line = line[MAX_LINE_BYTES // 4:]
            yield line


def reservoir_sample(lines: Iterable[str], k: int, seed: int) -> tuple[list[str], int]:
    """Uniform sample of k lines from a stream of unknown length in O(k) memory (Algorithm R)."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for seen, line in enumerate(lines, 1):
        if len(sample) < k:
            sample.append(line)
        else:
            j = rng.randrange(seen)
            if j < k:
                sample[j] = line
    return sample, seen


def train(args: argparse.Namespace) -> Tokenizer:
    files = expand_inputs(args.input)
    texts = (t for f in files for t in iter_texts(f, args.json_keys))
    t0 = time.time()
    sample, seen = reservoir_sample(iter_lines(texts), args.input_sentence_size, args.seed)
    if not sample:
        raise TokenizerError(f"--input {' '.join(args.input)}: no text found")
    print(f"sampled {len(sample):,} of {seen:,} lines from {len(files)} files "
          f"in {time.time() - t0:.1f}s", file=sys.stderr)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as tmp:
        tmp.write("\n".join(sample) + "\n")
        tmp.flush()
        try:
            spm.SentencePieceTrainer.train(
                input=tmp.name, model_prefix=args.output_prefix, model_type=args.model_type,
                vocab_size=args.vocab_size, byte_fallback=True,
                split_digits=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                add_dummy_prefix=False, character_coverage=args.character_coverage,
                max_sentencepiece_length=16, input_sentence_size=args.input_sentence_size,
                shuffle_input_sentence=True, num_threads=args.num_threads, minloglevel=2,
                **SPECIAL_IDS,
            )
        except RuntimeError as e:
            raise TokenizerError(
                f"tokenizer training failed: {e}\nCheck --vocab-size {args.vocab_size}: it must "
                "fit the corpus (sentencepiece names the largest allowed value) and hold every "
                "required character plus 256 byte-fallback pieces; or lower "
                "--character-coverage") from e
    tok = Tokenizer(args.output_prefix + ".model")
    print(f"wrote {args.output_prefix}.model and .vocab: {args.model_type}, vocab "
          f"{tok.vocab_size}, unk={tok.unk_id} bos={tok.bos_id} eos/eod={tok.eos_id} "
          f"pad={tok.pad_id}, {time.time() - t0:.1f}s", file=sys.stderr)
    return tok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    short = command if len(command) < 300 else command[:300] + " ..."
    print("command: python -m tokenizer.train " + short, file=sys.stderr)
    try:
        train(args)
    except TokenizerError as err:  # a user mistake: one line, as megatron_lite/errors.py does
        if args.debug or os.environ.get("MEGATRON_LITE_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
