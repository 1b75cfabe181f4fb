"""Exact resume, resharding across layouts and the TP=2 export, from two process spawns.

Spawning dominates the cost on a small CPU box, so every multi-rank run happens in one
module fixture: a 2-rank spawn trains TP=2, PP=2 v=2 and DP=2 ZeRO-1 one after the other
(`relayout`), a 4-rank spawn trains TP=2 x PP=2 and PP=4, and the single-process runs happen
in this process. Each resume's interrupted run (saved at iteration HALF) is also the source
of a reshard, and its resumed run is the "continued without reshard" reference.

Per layout X: `a` = ITERS iterations uninterrupted; `b` = HALF iterations (--exit-interval),
then resumed to ITERS. A reshard X -> Y loads X's `b`@HALF into Y, saves it at once (no
step), then continues to ITERS in Y.

Dtypes: the reshard sources and targets run float64 (`FLAGS`): a reshard must hold the
source's state bit for bit, and training continued in Y must follow X's to EXACT (only the
summation order differs; the same kind of reshard in test_sharding_layouts measures losses 0,
final weights and Adam state <= 7.5e-16). `single` and `tp2` resume in
fp32 (`FP32_FLAGS`), the dtype test of the default fp32 path (bit for bit); tp2's fp32 run
is also the tied export's source.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_lite.export import single_process_state
from tests.checkpoint.common import (
    FLAGS,
    FP32_FLAGS,
    HALF,
    HALF_SAMPLES,
    ITERS,
    LAYOUTS,
    assert_close_state,
    assert_same_state,
    check_hf_round_trip,
    relayout,
    run_sequence,
)
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close

FP32 = ("single", "tp2")
"""Layouts whose resume runs in fp32 (the dtype test); the others run float64."""

TWO_RANKS = ("tp2", "pp2-v2", "dp2-zero1")
PAIRS = [("tp2-pp2", "single"), ("dp2-zero1", "tp2"), ("pp2-v2", "pp4")]


def _resume(pstate, layout: str, root: Path) -> tuple[list[float], ...]:
    """(uninterrupted, first HALF, resumed) losses of `layout` under `root / layout`."""
    extra, d = LAYOUTS[layout][0], root / layout
    base = FP32_FLAGS if layout in FP32 else FLAGS
    return tuple(run_sequence(pstate, [[*extra, "--save", str(d / "a")],
                                       [*extra, "--save", str(d / "b"), "--exit-interval",
                                        str(HALF)],
                                       [*extra, "--save", str(d / "b")]], base))


def _reshard(pstate, source: str, target: str, root: Path) -> tuple[list[float], ...]:
    """Load `source`'s iteration HALF into `target`, save it unchanged, continue (float64)."""
    extra, y = LAYOUTS[target][0], root / f"{source}->{target}"
    return tuple(run_sequence(pstate, [
        [*extra, "--load", str(root / source / "b"), "--ckpt-step", str(HALF), "--save", str(y),
         "--train-iters", str(HALF)],
        [*extra, "--save", str(y)]]))


def _two_ranks(pstate, root: str) -> dict:
    root_path = Path(root)
    out = {}
    for layout in TWO_RANKS:
        _, _, tp, pp = LAYOUTS[layout]
        out[layout] = _resume(relayout(pstate, tp, pp), layout, root_path)
    out["dp2-zero1->tp2"] = _reshard(relayout(pstate, 2, 1), "dp2-zero1", "tp2", root_path)
    return out


def _four_ranks(pstate, root: str) -> dict:
    """TP=2 x PP=2 interrupted at HALF and resumed (reshard source); PP=2 v=2 -> PP=4."""
    root_path, extra = Path(root), LAYOUTS["tp2-pp2"][0]
    b = root_path / "tp2-pp2" / "b"
    out = {"tp2-pp2": (None, *run_sequence(pstate, [
        [*extra, "--save", str(b), "--exit-interval", str(HALF)], [*extra, "--save", str(b)]]))}
    out["pp2-v2->pp4"] = _reshard(relayout(pstate, 1, 4), "pp2-v2", "pp4", root_path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("layouts")
    two = run_ranks(_two_ranks, 2, root, timeout=240, root=str(root))
    four = run_ranks(_four_ranks, 4, root, tp=2, pp=2, timeout=240, root=str(root))
    for rank_results in (two, four):
        assert all(r == rank_results[0] for r in rank_results)  # every rank saw the same loss
    single = single_process_state()
    out = {**two[0], **four[0], "single": _resume(single, "single", root),
           "tp2-pp2->single": _reshard(single, "tp2-pp2", "single", root)}
    return out, root


def _same_files(a: Path, b: Path) -> None:
    """Every tensor of every file (weights, optimizer shards, RNG) equal; same file set."""
    files_a = json.loads((a / "metadata.json").read_text())["files"]
    files_b = json.loads((b / "metadata.json").read_text())["files"]
    assert sorted(files_a) == sorted(files_b)
    for name in files_a:
        ta, tb = load_file(a / name), load_file(b / name)
        assert sorted(ta) == sorted(tb), name
        for key in ta:
            assert ta[key].equal(tb[key]), (name, key)


def _it(i: int) -> str:
    return f"iter_{i:07d}"


@pytest.mark.parametrize("layout", ["single", *TWO_RANKS])
def test_resume_is_bit_identical(runs, layout: str) -> None:
    """Interrupted at iteration HALF and resumed = uninterrupted, bit for bit (losses and every
    saved tensor at the end), in fp32 (`FP32`) or float64."""
    out, root = runs
    _, _, tp, pp = LAYOUTS[layout]
    full, first, resumed = out[layout]
    a, b = root / layout / "a", root / layout / "b"
    assert len(full) == ITERS and len(first) == HALF and len(resumed) == ITERS - HALF
    assert first == full[:HALF]
    assert resumed == full[HALF:], (resumed, full)  # exact float equality
    assert (b / "latest").read_text().strip() == _it(ITERS)
    _same_files(a / _it(ITERS), b / _it(ITERS))
    meta = json.loads((b / _it(HALF) / "metadata.json").read_text())
    assert meta["iteration"] == HALF and meta["consumed_samples"] == HALF_SAMPLES
    assert meta["layout"]["tp"] == tp and meta["layout"]["pp"] == pp
    assert meta["config"]["train"]["fp64"] is (layout not in FP32)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_round_trip(runs, source: str, target: str) -> None:
    """X's iteration HALF loaded into Y has the same full weights and optimizer state (float64,
    bit for bit), and training continued in Y follows training continued in X: losses and the
    final weights and Adam state to EXACT."""
    out, root = runs
    loaded, continued_y = out[f"{source}->{target}"]
    continued_x = out[source][-1]
    assert loaded == []
    y = root / f"{source}->{target}"
    assert_same_state(root / source / "b" / _it(HALF), y / _it(HALF))
    assert len(continued_y) == len(continued_x) == ITERS - HALF
    assert_close(continued_y, continued_x, EXACT, "continued losses")
    assert_close_state(y / _it(ITERS), root / source / "b" / _it(ITERS))


def test_tp2_tied_export_matches_transformers(runs, tmp_path) -> None:
    pytest.importorskip("transformers")
    from tokenizer.train import main as train_tokenizer

    text = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    train_tokenizer(["--input", str(text), "--output-prefix", str(tmp_path / "tok"),
                     "--vocab-size", "400", "--num-threads", "1"])
    hf = check_hf_round_trip(runs[1] / "tp2" / "a", ITERS, tmp_path, "--tokenizer-model",
                             str(tmp_path / "tok.model"))
    config = json.loads((hf / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (hf / "tokenizer.model").read_bytes() == (tmp_path / "tok.model").read_bytes()
