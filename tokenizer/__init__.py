"""sentencepiece tokenizer: training (`python -m tokenizer.train`) and loading. No torch."""

from tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
