"""--ckpt-staging-buffer-gb: a save streams through one bounded staging buffer.

The files are byte-identical whatever the buffer's size (a 4 KiB buffer cuts this tiny
model's files into many pieces), to `safetensors.torch.save`'s too; the buffer is the only
host memory a plain save keeps, and its size is the flag's (or the largest file's, when that
is smaller); a resume from a many-piece save continues bit-exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from megatron_lite.checkpoint import files as F
from megatron_lite.checkpoint.checkpointer import GIB, HostStaging
from megatron_lite.training import train_step
from tests.checkpoint.test_staging import run_with_checkpointer

TINY = 4096
"""Bytes: far below one file of the model below, so every file takes many pieces."""


def _run(save_dir: Path, buffer_bytes: int, *flags: str) -> tuple:
    return run_with_checkpointer(save_dir, "--ckpt-staging-buffer-gb", str(buffer_bytes / GIB),
                                 *flags)


def _counting(staging: HostStaging, counts: list[int]) -> None:
    """Count the pieces each streamed file takes."""
    pieces = staging.pieces

    def counted(tensors):
        counts.append(0)
        for piece in pieces(tensors):
            counts[-1] += 1
            yield piece

    staging.pieces = counted  # type: ignore[method-assign]


def _save_two_steps(save_dir: Path, buffer_bytes: int, *flags: str) -> tuple:
    ps, chunks, opt, loader, ckpt, runner = _run(save_dir, buffer_bytes, *flags)
    counts: list[int] = []
    _counting(ckpt.staging, counts)
    for _ in range(2):
        train_step(runner, opt, loader, ps, lr=2e-3)
    ckpt.save(2)
    ckpt.wait()
    return (ps, chunks, opt, loader, ckpt, runner), counts


def _files(save_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes()
            for p in sorted((save_dir / F.iter_dir_name(2)).glob("*.safetensors"))}


@pytest.mark.quick
def test_streamed_header_and_bytes_are_safetensors_own(tmp_path) -> None:
    """Every dtype order, empty and 0-d tensors, non-ASCII metadata, a 3-byte staging
    buffer (pieces end inside elements): the same bytes as `safetensors.torch.save`."""
    tensors = {"w": torch.randn(3, 5), "h": torch.randn(7).to(torch.bfloat16),
               "ids": torch.arange(4), "mask": torch.tensor([True, False, True]),
               "a0": torch.zeros(0), "s": torch.tensor(2.5, dtype=torch.float64),
               "u": torch.arange(6, dtype=torch.uint8)}
    meta = {"note": "é \" \\ \n", "n": [1, 2]}
    size, digest = F.write_tensors(tmp_path / "f.safetensors", tensors, meta,
                                   HostStaging(limit_bytes=3).pieces)
    expected = save(tensors, metadata={"format": "pt", "megatron_lite": F.json.dumps(meta)})
    written = (tmp_path / "f.safetensors").read_bytes()
    assert size == len(written) == len(expected)
    assert digest == F.hashlib.sha256(written).hexdigest()
    # safetensors keeps the metadata in a hash map, so its own header lists those keys in an
    # order that changes between processes; everything else must be the same bytes.
    got, want = _split(written), _split(expected)
    assert got[0] == want[0] and got[2] == want[2]  # header length, tensor data
    assert F.json.loads(got[1]) == F.json.loads(want[1])
    tensors_only = [{k: v for k, v in F.json.loads(h).items() if k != "__metadata__"}
                    for h in (got[1], want[1])]
    assert list(tensors_only[0]) == list(tensors_only[1])  # the data order


def _split(blob: bytes) -> tuple[int, bytes, bytes]:
    """(header length, header JSON, data) of a safetensors file."""
    n = int.from_bytes(blob[:8], "little")
    return n, blob[8:8 + n], blob[8 + n:]


@pytest.mark.parametrize("async_save", [False, True])
def test_tiny_buffer_saves_the_same_files(tmp_path, async_save: bool) -> None:
    flags = ["--async-save"] if async_save else []
    (_, _, opt, _, tiny, _), pieces = _save_two_steps(tmp_path / "tiny", TINY, *flags)
    opt.close()
    (_, _, opt, _, large, _), large_pieces = _save_two_steps(tmp_path / "large", GIB, *flags)
    opt.close()
    small, big = _files(tmp_path / "tiny"), _files(tmp_path / "large")
    assert sorted(small) == sorted(big) and len(small) == 3
    for name in small:
        assert small[name] == big[name], name
    if async_save:  # the copies are host memory already: the writer needs no staging
        assert pieces == [] and large_pieces == []
        return
    assert len(pieces) == 3 and min(pieces[:2]) > 10  # model and optimizer files: many pieces
    assert len(large_pieces) == 3 and max(large_pieces) == 1
    # What a plain save keeps: the buffer and nothing else, of the flag's size, or (large)
    # of the largest file's data, the optimizer's.
    assert tiny.staging.buffers == {} and tiny.staging.allocated_bytes() == TINY
    data = {name: len(b) - 8 - int.from_bytes(b[:8], "little") for name, b in big.items()}
    assert max(data, key=data.get) == F.optim_file(0, 0, 0) and data[name] > TINY
    assert large.staging.allocated_bytes() == max(data.values())


def test_resume_from_a_many_piece_save_is_bit_exact(tmp_path) -> None:
    (ps, chunks, opt, loader, _, runner), pieces = _save_two_steps(tmp_path / "ck", TINY)
    assert min(pieces[:2]) > 10
    for _ in range(2):
        train_step(runner, opt, loader, ps, lr=2e-3)
    with opt.gathered_params():
        straight = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    opt.close()
    ps, chunks, opt, loader, ckpt, runner = _run(tmp_path / "ck", TINY)
    assert ckpt.load() == 2
    for _ in range(2):
        train_step(runner, opt, loader, ps, lr=2e-3)
    with opt.gathered_params():
        for name, p in chunks[0].named_parameters():
            assert torch.equal(p, straight[name]), name
    opt.close()
