"""document_layout against a token-by-token reading of Megatron's rule (the token after an EOD
starts a new document; positions restart there under --reset-position-ids)."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.data.documents import document_layout

EOD = 0


def _reference(row: list[int], reset_position_ids: bool) -> tuple[list[int], list[int]]:
    docs, positions, doc, pos = [], [], 0, 0
    for i, token in enumerate(row):
        docs.append(doc)
        positions.append(pos if reset_position_ids else i)
        pos += 1
        if token == EOD:
            doc, pos = doc + 1, 0
    return docs, positions


@pytest.mark.parametrize("reset_position_ids", [True, False])
def test_matches_token_by_token_rule(reset_position_ids: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (4, 37), generator=gen)  # ~20% EOD
    tokens[0, 0] = EOD  # EOD first: the next token is document 1
    tokens[1, -1] = EOD  # EOD last: it still belongs to the document it ends
    tokens[2] = 3  # no EOD at all: one document, positions 0..s-1
    documents, positions = document_layout(tokens, EOD, reset_position_ids=reset_position_ids)
    assert documents.dtype == torch.int32 and positions.dtype == torch.int64
    for r in range(tokens.shape[0]):
        docs, pos = _reference(tokens[r].tolist(), reset_position_ids)
        assert documents[r].tolist() == docs
        assert positions[r].tolist() == pos


@pytest.mark.quick
def test_small_example() -> None:
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9]])
    documents, positions = document_layout(tokens, EOD, reset_position_ids=True)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert (documents.diff(dim=1) >= 0).all()


def test_rejects_flat_tokens() -> None:
    with pytest.raises(ValueError, match="batch, seq"):
        document_layout(torch.zeros(8, dtype=torch.long), EOD, reset_position_ids=True)
