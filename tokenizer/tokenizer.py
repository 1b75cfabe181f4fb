"""Load any sentencepiece `.model` (ours or one trained elsewhere, e.g. Llama's)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import overload

import sentencepiece as spm


class TokenizerError(ValueError):
    """A tokenizer model or training input that cannot be used; the message names the file and
    the fix. The entrypoints print it as one `error:` line (megatron_lite/errors.py)."""


class Tokenizer:
    """Thin wrapper giving the ids the trainer needs: vocab size, BOS/EOS/PAD, EOD (= EOS)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = Path(model_path)
        train = "`python -m tokenizer.train --input ... --output-prefix ... --vocab-size ...`"
        if not self.model_path.is_file():
            raise TokenizerError(f"--tokenizer-model {model_path}: no such file; train one with "
                                 + train)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"--tokenizer-model {model_path}: not a sentencepiece model "
                                 f"({e}); pass the .model file that {train} wrote") from e

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        return _optional(self.sp.bos_id())

    @property
    def eos_id(self) -> int | None:
        return _optional(self.sp.eos_id())

    @property
    def pad_id(self) -> int | None:
        return _optional(self.sp.pad_id())

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    @property
    def eod_id(self) -> int:
        """Token appended after each document (Megatron's EOD): the EOS id."""
        if self.eos_id is None:
            raise TokenizerError(f"{self.model_path} has no EOS piece to mark document ends")
        return self.eos_id

    def sha256(self) -> str:
        return hashlib.sha256(self.model_path.read_bytes()).hexdigest()

    @overload
    def encode(self, text: str, num_threads: int = ...) -> list[int]: ...
    @overload
    def encode(self, text: list[str], num_threads: int = ...) -> list[list[int]]: ...

    def encode(self, text, num_threads: int = 1):
        """Ids of one text, or of each text of a list (batch: `num_threads` spm threads)."""
        return self.sp.encode(text, num_threads=num_threads)

    def decode(self, ids: list[int] | list[list[int]]) -> str | list[str]:
        return self.sp.decode(ids)

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def save_hf(self, out: Path) -> None:
        """Hugging Face's Llama tokenizers load the sentencepiece file as `tokenizer.model`."""
        (out / "tokenizer.model").write_bytes(self.model_path.read_bytes())


def _optional(token_id: int) -> int | None:
    return None if token_id < 0 else token_id
