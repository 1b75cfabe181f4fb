"""Megatron's data flags mean the same here: every --split spelling it parses, unweighted
`--data-path A B` blends, an evaluation that moves on through a validation set sized as
Megatron sizes it (and resumes where it would have been), --no-create-attention-mask-in-
dataloader. Expected values are written out from Megatron's rules, not read from our code."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError, parse_blend, parse_split
from megatron_lite.data import builder
from megatron_lite.data.builder import build_loaders, resolve_tokenizer
from megatron_lite.data.dataset import BlendedDataset, split_ranges
from megatron_lite.data.index import samples_per_epoch
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import eval_start, train
from tests.data.test_split_paths import EOD, corpus


@pytest.mark.quick
@pytest.mark.parametrize("spelling, weights", [
    ("969,30,1", (969, 30, 1)), ("969, 30, 1", (969, 30, 1)), ("99,1,0", (99, 1, 0)),
    ("99 1 0", (99, 1, 0)), ("99/1/0", (99, 1, 0)), ("98,2", (98, 2, 0)), ("1", (1, 0, 0)),
    ("0.98,0.015,.005", (0.98, 0.015, 0.005)), ("2,2,4", (2, 2, 4))])
def test_every_split_spelling_normalizes_as_megatron(spelling: str, weights: tuple) -> None:
    total = sum(weights)
    assert parse_split(spelling) == pytest.approx([w / total for w in weights], abs=1e-15)
    assert sum(parse_split(spelling)) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("bad", ["", "a,b", "-1,2,0", "1e-3,1", "1,2,3,4", "0,0,0", "1.2.3,1"])
def test_a_bad_split_names_the_flag(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"--split .*969,30,1"):
        parse_split(bad)


def test_split_bounds_round_the_normalized_cumulative_sums() -> None:
    # Megatron: bounds [0, w0, w0 + w1, w0 + w1 + w2] of the normalized weights, each
    # int(round(bound * documents)); 1/3 of 100 documents is 33.3 -> 33, 2/3 -> 66.7 -> 67.
    assert split_ranges("1 1 1", 100) == [(0, 33), (33, 67), (67, 100)]
    assert split_ranges("99/1/0", 1000) == [(0, 990), (990, 1000), (1000, 1000)]


def test_blend_syntax_weighted_unweighted_and_mixed() -> None:
    assert parse_blend(["A"]) == [(None, "A")]
    assert parse_blend(["A", "B"]) == [(None, "A"), (None, "B")]
    assert parse_blend(["A", "B", "C"]) == [(None, "A"), (None, "B"), (None, "C")]
    assert parse_blend(["0.3", "A", "70", "B"]) == [(0.3, "A"), (70.0, "B")]
    with pytest.raises(ConfigError, match=r"--valid-data-path 0\.3 A B C: `B` stands where"):
        parse_blend(["0.3", "A", "B", "C"], "--valid-data-path")
    with pytest.raises(ConfigError, match="--data-path -1 A 2 B: weight -1 is not a finite"):
        parse_blend(["-1", "A", "2", "B"])


def test_an_unweighted_blend_reads_each_source_by_its_size(tmp_path) -> None:
    """`--data-path A B` (a traceback before): Megatron weighs each source by its samples in
    the split, so both are read at one rate (here A's documents are longer than B's)."""
    a, b = corpus(tmp_path / "a", 3, 250), corpus(tmp_path / "b", 300, 400)
    flags = ["--seq-length", "16", "--train-iters", "20", "--eval-iters", "0",
             "--global-batch-size", "4", "--split", "90 10 0"]
    cfg = parse_config([*flags, "--data-path", a, b])
    resolve_tokenizer(cfg)
    train_set = build_loaders(cfg, 0, 1).train.dataset
    assert isinstance(train_set, BlendedDataset) and len(train_set) == 80
    expected = []
    for part in train_set.datasets:  # the independent weight: train-split samples per pass
        start, end = part.doc_range
        expected.append(samples_per_epoch(int(part.corpus.sizes[start:end].sum()), 16))
    share = np.bincount(train_set.dataset_index, minlength=2) / len(train_set)
    assert expected[0] != expected[1]
    assert share == pytest.approx(np.array(expected) / sum(expected), abs=1 / 80)
    weighted = parse_config([*flags, "--data-path", "1", a, "3", b])
    resolve_tokenizer(weighted)
    index = build_loaders(weighted, 0, 1).train.dataset.dataset_index
    assert np.bincount(index).tolist() == [20, 60]


@pytest.mark.quick
def test_evaluation_k_reads_the_kth_group_of_batches() -> None:
    cfg = parse_config(["--mock-data", "--train-iters", "7", "--eval-interval", "3",
                        "--eval-iters", "2"])
    # evaluations after iterations 3, 6 and (the end) 7: batches 0-1, 2-3, 4-5 of 5 samples
    assert [eval_start(cfg, i, 5) for i in (3, 6, 7)] == [0, 10, 20]
    # Megatron sizes the validation set for train_iters // eval_interval + 1 evaluations
    assert builder.validation_samples(cfg, 5) == (7 // 3 + 1) * 2 * 5


def _eval_losses(tmp_path, *extra: str) -> list[float]:
    flags = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "64",
             "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "64",
             "--micro-batch-size", "2", "--train-iters", "4", "--eval-interval", "1",
             "--eval-iters", "1", "--fp64", "--peak-tflops", "1", "--log-interval", "100",
             "--lr", "0", "--min-lr", "0", *extra]
    return train(parse_config(flags), single_process_state()).eval_losses


def test_evaluation_moves_on_and_resumes_where_it_would_have_been(tmp_path) -> None:
    """At LR 0 the weights never change, so an evaluation's loss says which batches it read:
    all different (re-reading the first batches would repeat one value), and a run resumed
    at iteration 2 reads those of evaluations 3 and 4, not the first ones again."""
    whole = _eval_losses(tmp_path)
    assert len(set(whole)) == 4, f"each evaluation should read new batches: {whole}"
    save = str(tmp_path / "ckpt")
    head = _eval_losses(tmp_path, "--save", save, "--exit-interval", "2")
    tail = _eval_losses(tmp_path, "--save", save, "--load", save)
    assert head + tail == whole  # float64, same batches: bit for bit


def test_no_dataloader_mask_leaves_documents_unseparated(tmp_path) -> None:
    """Megatron's --reset-attention-mask edits the dataloader's mask: without that mask
    (--no-create-attention-mask-in-dataloader) attention stays causal across documents, while
    --reset-position-ids still restarts positions."""
    data = corpus(tmp_path / "a", 3, 250)
    base = ["--seq-length", "16", "--eval-iters", "0", "--data-path", data,
            "--reset-attention-mask", "--reset-position-ids"]
    for extra, documents in (([], True), (["--no-create-attention-mask-in-dataloader"], False)):
        cfg = parse_config([*base, *extra])
        resolve_tokenizer(cfg)
        (batch,) = build_loaders(cfg, 0, 1).train.next_step()
        assert ("documents" in batch) == documents
        ends = (batch["tokens"] == EOD).nonzero()
        row, col = (int(x) for x in ends[0])
        assert batch["positions"][row, col + 1] == 0  # positions restart either way
