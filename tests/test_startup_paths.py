"""User paths and values refused at start-up, before anything is built (issue 31, Why 5): each
mistake is one `error:` line, exit status 2 and no training step; before, they surfaced after
training (--save a file), at the first save or log line, as tracebacks, or not at all."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

import pretrain
from data_tools.preprocess import main as preprocess_main
from megatron_lite.config import NUMERIC_RANGES, SECTIONS
from megatron_lite.data.format import ShardWriter
from tokenizer.train import main as train_tokenizer

TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--vocab-size", "64", "--ffn-hidden-size", "32",
        "--micro-batch-size", "1", "--train-iters", "2", "--eval-iters", "0",
        "--num-workers", "0", "--peak-tflops", "1"]


@pytest.fixture
def tree(tmp_path) -> Path:
    """A file, a directory and two bare shards (A, B) to point flags at."""
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "adir").mkdir()
    for name in "AB":
        w = ShardWriter(tmp_path / name, np.uint16)
        w.add_documents(np.arange(400) % 60 + 2, np.full(10, 40))
        w.finalize()
    return tmp_path


def _refused(argv: list[str], capfd: pytest.CaptureFixture) -> str:
    """pretrain.py's error line for `argv`, asserting exit 2, one line and no step run."""
    code = pretrain.main(argv)
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, out[-2000:] + err[-2000:]
    assert "Traceback" not in err and not re.search(r"^iter ", out, re.M), out[-2000:]
    return err[err.index("error:"):]


# (flags, with {d} = the tree; what the error line must say)
PATH_MISTAKES = {
    "save is a file": (["--save", "{d}/afile"], r"--save \S+/afile: is a file, not a directory"),
    "save under a file": (["--save", "{d}/afile/ckpt", "--save-interval", "1"],
                          r"--save \S+/afile/ckpt: \S+/afile is a file, so the directory"),
    "log-jsonl is a directory": (["--log-jsonl", "{d}/adir"],
                                 r"--log-jsonl \S+/adir: is a directory; pass a file path"),
    "tensorboard-dir is a file": (["--tensorboard-dir", "{d}/afile"],
                                  r"--tensorboard-dir \S+/afile: is a file"),
    "profile-dir under a file": (["--profile", "--profile-step-start", "0",
                                  "--profile-step-end", "1", "--profile-dir", "{d}/afile/p"],
                                 r"--profile-dir \S+/afile/p: \S+/afile is a file"),
    "load is a file": (["--load", "{d}/afile"], r"--load \S+/afile: is a file, not a directory"),
    "missing tokenizer with mock data": (["--tokenizer-model", "{d}/none.model"],
                                         r"--tokenizer-model \S+/none\.model: does not exist"),
    "micro-batch-size 0": (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    "train-iters 0 with mock data": (["--train-iters", "0"], "--train-iters must be >= 1, got 0"),
    "log-interval 0": (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
}


@pytest.mark.quick
@pytest.mark.parametrize("mistake", PATH_MISTAKES)
def test_a_bad_path_or_value_is_refused_before_training(tree, mistake, capfd) -> None:
    flags, expected = PATH_MISTAKES[mistake]
    line = _refused([*TINY, *(f.format(d=tree) for f in flags)], capfd)
    assert re.search(expected, line), line


BLENDS = {
    "weight without a path": ("0.5 {d}/A 0.5", r"3 entries, not weight/path pairs: `0\.5` is "
                              "left over"),
    "path without a weight": ("0.5 {d}/A {d}/B", r"3 entries, not weight/path pairs: `\S+/B`"),
    "negative weight": ("-0.5 {d}/A 1.5 {d}/B", r"weight -0\.5 is not a finite number >= 0"),
    "zero weights": ("0 {d}/A 0 {d}/B", "the weights sum to 0"),
    "overflowing weights": ("1e308 {d}/A 1e308 {d}/B", "the weights sum to inf"),
}


@pytest.mark.parametrize("blend", BLENDS)
def test_every_malformed_blend_is_named(tree, blend, capfd) -> None:
    given, expected = BLENDS[blend]
    flags = [f for f in TINY if f != "--mock-data"] + ["--tokenizer-type", "NullTokenizer",
                                                       "--data-path",
                                                       *given.format(d=tree).split()]
    line = _refused(flags, capfd)
    assert line.startswith("error: --data-path ") and re.search(expected, line), line


def test_every_numeric_field_has_a_range() -> None:
    """The rule table covers every int/float flag (the optimizer's have their own checks;
    the choice-valued --empty-unused-memory-level and --spike-lr-factor are left out)."""
    exempt = {("train", "empty_unused_memory_level"), ("reliability", "spike_lr_factor")}
    missing = [(section, f.name) for section, cls in SECTIONS.items() if section != "optim"
               for f in dataclasses.fields(cls)
               if str(f.type).removesuffix(" | None") in ("int", "float")
               and f.name not in NUMERIC_RANGES.get(section, {})
               and (section, f.name) not in exempt]
    assert not missing
    fields = {s: {f.name for f in dataclasses.fields(c)} for s, c in SECTIONS.items()}
    assert all(name in fields[s] for s, rules in NUMERIC_RANGES.items() for name in rules)


def test_preprocessing_no_documents_is_an_error(tmp_path, capsys) -> None:
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    assert train_tokenizer(["--input", str(tmp_path / "text.txt"), "--output-prefix",
                            str(tmp_path / "tok"), "--vocab-size", "300",
                            "--num-threads", "1"]) == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n")
    for src in (empty, blank):
        capsys.readouterr()
        code = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                "--tokenizer-model", str(tmp_path / "tok.model"),
                                "--workers", "1"])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^error: --input \S+: no documents in 1 file", err,
                                       re.M), err
        assert not list(tmp_path.glob("o*"))  # no shard, no manifest


def test_a_missing_load_is_found_before_the_model_is_built(tmp_path, monkeypatch) -> None:
    import megatron_lite.training as training
    from megatron_lite.arguments import parse_config
    from megatron_lite.checkpoint.files import CheckpointError

    def built(*_args, **_kwargs):
        raise AssertionError("the model was built before the --load check")

    monkeypatch.setattr(training, "build_model", built)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        training.run(parse_config([*TINY, "--load", str(tmp_path / "typo")]))
