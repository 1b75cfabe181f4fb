"""Document layout of packed sequences: which document each token belongs to, and its position.

A training sample is a window of the concatenated corpus, so it holds several documents
separated by the end-of-document token. Megatron-LM's `--reset-attention-mask` stops attention
across those boundaries and `--reset-position-ids` restarts RoPE positions in each document;
both need the same per-token answer, computed here once per micro-batch on the full
(un-split) sequence, before context parallelism hands each rank its chunks.

The EOD token belongs to the document it ends; the token after it starts the next one
(Megatron's rule: the mask and position reset take effect from index eod + 1).
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_layout(tokens: Tensor, eod_id: int, *, reset_position_ids: bool
                    ) -> tuple[Tensor, Tensor]:
    """Return (documents [b, s] int32, positions [b, s] int64) for `tokens` [b, s].

    documents counts the EOD tokens strictly before each token, so ids start at 0 in every row
    and never decrease along it. positions restart at 0 at each document start when
    `reset_position_ids`, else they are 0..s-1.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    is_eod = (tokens == eod_id).to(torch.int32)
    documents = (torch.cumsum(is_eod, dim=1, dtype=torch.int32) - is_eod).to(torch.int32)
    index = torch.arange(s, device=tokens.device).expand(b, s)
    if not reset_position_ids:
        return documents, index.clone()
    # A document starts at 0 or right after an EOD; each token's start is the latest one.
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(is_eod[:, :-1].bool(), index[:, 1:], 0)
    return documents, index - torch.cummax(starts, dim=1).values
