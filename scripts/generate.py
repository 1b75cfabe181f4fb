"""Generate text from a checkpoint (any parallel layout) on one process.

    python scripts/generate.py --load CKPT_DIR [--tokenizer-model TOK.model] \
        --prompt "def main(" --max-new-tokens 64 [--top-k 0] [--temperature 1.0]

The checkpoint is gathered into one TP=PP=1 model (megatron_lite.export.load_model). The
tokenizer is the run's (its --tokenizer-type and files, from the checkpoint's config); the
tokenizer flags of pretrain.py replace it, e.g. when the files have moved.
--top-k 0 is greedy decoding. No KV cache: each new token reruns the (short) context, which
is plenty for the small models this is meant to inspect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.errors import add_debug_flag, run_cli
from megatron_lite.export import load_model, model_logits
from tokenizer.spec import TextTokenizer, TokenizerSpec, add_tokenizer_flags, load_tokenizer


def sample_next(logits: torch.Tensor, top_k: int, temperature: float,
                generator: torch.Generator) -> int:
    """Greedy when top_k == 0, else sample among the k most likely tokens."""
    if top_k <= 0:
        return int(logits.argmax())
    values, ids = logits.topk(min(top_k, logits.numel()))
    probs = torch.softmax(values / max(temperature, 1e-6), dim=-1)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


def generate(chunk, prompt_ids: list[int], *, vocab_size: int, context: int,
             max_new_tokens: int, top_k: int = 0, temperature: float = 1.0,
             eos_id: int | None = None, seed: int = 0) -> list[int]:
    ids = list(prompt_ids)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]])
        next_id = sample_next(model_logits(chunk, window, vocab_size)[0, -1], top_k,
                              temperature, generator)
        ids.append(next_id)
        if next_id == eos_id:
            break
    return ids[len(prompt_ids):]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint directory (latest is used)")
    parser.add_argument("--ckpt-step", type=int, help="use this iteration instead of latest")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=0, help="0 = greedy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    add_tokenizer_flags(parser)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with torch.no_grad():
        model_cfg, chunk = load_model(Path(args.load), args.ckpt_step)
        tok = _tokenizer(args, Path(args.load))
        if tok.vocab_size != model_cfg.vocab_size:
            parser.error(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's model "
                         f"has a vocabulary of {model_cfg.vocab_size}: pass the training tokenizer")
        prompt = tok.encode([args.prompt])[0] if args.prompt else []
        if not prompt:  # nothing to continue: start a document
            start = tok.bos_id if tok.bos_id is not None else tok.eod_id
            if start is None:
                parser.error("the tokenizer has no BOS or EOD token to start from: pass --prompt")
            prompt = [start]
        out = generate(chunk, prompt, vocab_size=model_cfg.vocab_size,
                       context=model_cfg.max_position_embeddings,
                       max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                       temperature=args.temperature, eos_id=tok.eod_id, seed=args.seed)
    print(args.prompt + tok.decode(out))
    return 0


def _tokenizer(args: argparse.Namespace, load: Path) -> TextTokenizer:
    """The tokenizer flags given here, else the run's, from the checkpoint's saved config."""
    given = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
             "vocab_file": args.vocab_file, "merge_file": args.merge_file}
    if any(given.values()):
        data = {**given, "tiktoken_pattern": args.tiktoken_pattern,
                "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
                "special_tokens": args.tokenizer_special_tokens,
                "null_tokenizer_eod_id": args.null_tokenizer_eod_id,
                "tokenizer_hf_no_include_special_tokens":
                    args.tokenizer_hf_no_include_special_tokens}
        vocab = args.vocab_size
    else:
        ckpt_dir = ckpt_files.resolve_checkpoint_dir(load, args.ckpt_step)
        saved = ckpt_files.read_metadata(ckpt_dir)["config"]
        data, vocab = saved["data"], saved["model"]["vocab_size"]
    spec = TokenizerSpec.from_data_config(data, vocab)
    if spec is None:
        raise ckpt_files.CheckpointError(f"the run saved in {load} had no tokenizer (mock or "
                                         "id-only data): pass --tokenizer-model and its "
                                         "--tokenizer-type")
    return load_tokenizer(spec)


def main(argv: list[str] | None = None) -> int:
    """A bad --load or tokenizer file ends in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
