"""Start-up data preparation done once: shard verdicts cached by content fingerprint, the
index built by one rank while the others wait at a barrier and memory-map it, unwritable
caches refused by flag, and a preparer's failure or delay reported by name on every rank."""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.data import format as fmt
from megatron_lite.data.builder import build_loaders
from megatron_lite.data.format import ShardVerdicts, ShardWriter, shard_name, write_manifest
from megatron_lite.data.index import CacheError, load_or_build
from megatron_lite.errors import UserError
from megatron_lite.training import data_coordinator
from tests.distributed import run_ranks

VOCAB = 97
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--vocab-size", str(VOCAB), "--micro-batch-size", "1",
        "--eval-iters", "0", "--train-iters", "2", "--num-workers", "0",
        "--tokenizer-type", "NullTokenizer", "--ffn-hidden-size", "64"]


def bare_shard(prefix: Path, docs: int = 30, top: int = VOCAB, seed: int = 0) -> None:
    """A `.bin/.idx` pair without a manifest (ids below `top`)."""
    rng = np.random.default_rng(seed)
    w = ShardWriter(prefix, np.uint16)
    for _ in range(docs):
        doc = rng.integers(0, top - 1, size=int(rng.integers(4, 30)))
        w.add_documents(np.append(doc, top - 1), np.array([len(doc) + 1]))
    w.finalize()


@pytest.mark.quick
def test_a_shard_is_scanned_once_then_trusted(tmp_path, capsys):
    bare_shard(tmp_path / "s")
    verdicts = ShardVerdicts(tmp_path / "cache", rank=3)
    first = verdicts.open(str(tmp_path / "s"), vocab_size=VOCAB)
    out = capsys.readouterr().out
    assert out.count("data: rank 3 scanned") == 1 and f"ids 0..{VOCAB - 1}" in out
    (verdict,) = (tmp_path / "cache" / "shard_checks").glob("s.*.json")
    assert '"scan": "full"' in verdict.read_text()
    again = ShardVerdicts(tmp_path / "cache", rank=5).open(str(tmp_path / "s"),
                                                           vocab_size=VOCAB)
    assert capsys.readouterr().out == ""  # the verdict stands: no scan, no pointer pass
    assert again.num_tokens == first.num_tokens
    np.testing.assert_array_equal(again[3], first[3])


def test_a_rewritten_shard_is_validated_again(tmp_path, capsys):
    bare_shard(tmp_path / "s")
    ShardVerdicts(tmp_path / "cache").open(str(tmp_path / "s"), vocab_size=VOCAB)
    capsys.readouterr()
    bare_shard(tmp_path / "s", top=500, seed=2)  # same name, other tokenizer: new size/mtime
    with pytest.raises(fmt.ShardError, match=r"token id .* at token offset .* outside"):
        ShardVerdicts(tmp_path / "cache").open(str(tmp_path / "s"), vocab_size=VOCAB)
    assert "scanned" in capsys.readouterr().out
    # the verdict records the range, so the next start refuses it without a scan, by offset
    with pytest.raises(fmt.ShardError, match="at token offset"):
        ShardVerdicts(tmp_path / "cache").open(str(tmp_path / "s"), vocab_size=VOCAB)
    st = os.stat(tmp_path / "s.bin")
    os.utime(tmp_path / "s.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    ShardVerdicts(tmp_path / "cache").open(str(tmp_path / "s"), vocab_size=600)
    assert "scanned" in capsys.readouterr().out


def test_a_corrupt_shard_gets_no_verdict(tmp_path):
    bare_shard(tmp_path / "s")
    with open(tmp_path / "s.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "s.bin") - 2)
    for _ in range(2):  # refused every time, never vouched for
        with pytest.raises(fmt.ShardError, match=r"s\.bin: size"):
            ShardVerdicts(tmp_path / "cache").open(str(tmp_path / "s"), vocab_size=VOCAB)
    assert not list((tmp_path / "cache").rglob("*.json"))


def test_unwritable_cache_is_refused_for_others_and_a_warning_alone(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory\n")
    blocked = tmp_path / "file" / "cache"
    bare_shard(tmp_path / "s")
    with pytest.raises(fmt.ShardError, match=r"--data-cache-path.*every rank validates"):
        ShardVerdicts(blocked, required=True).open(str(tmp_path / "s"), vocab_size=VOCAB)
    sizes = np.array([5, 9, 7], dtype=np.int32)
    with pytest.raises(CacheError, match="would build the index again; set --data-cache-path"):
        load_or_build(blocked, {"k": 1}, sizes, 4, 1, 0, required=True)
    capsys.readouterr()
    ShardVerdicts(blocked).open(str(tmp_path / "s"), vocab_size=VOCAB)  # one process: warns
    index = load_or_build(blocked, {"k": 1}, sizes, 4, 1, 0)
    err = capsys.readouterr().err
    assert "--data-cache-path" in err and "shard verdicts" in err and index.samples_per_epoch == 5


# ---------------------------------------------------------------- several ranks (gloo)


def _prepare(pstate, flags: list[str]) -> tuple[str, str | None]:
    """build_loaders on this rank with the coordinator training makes: (output, error)."""
    cfg = parse_config([*TINY, *flags])
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            build_loaders(cfg, pstate.dp_rank, pstate.dp_size,
                          coordinator=data_coordinator(cfg, pstate))
        return out.getvalue(), None
    except UserError as e:
        return out.getvalue(), str(e)


def _scenarios(pstate, root: str) -> dict[str, tuple[str, str | None]]:
    """Every multi-rank case in one process group (spawning ranks is the slow part)."""
    root_path = Path(root)
    blend = ["--data-path", "0.5", f"{root}/a", "0.5", f"{root}/b",
             "--data-cache-path", f"{root}/cache"]
    runs = {"fresh": _prepare(pstate, blend), "restart": _prepare(pstate, blend)}
    runs["node-local"] = _prepare(pstate, ["--data-path", f"{root}/c", "--data-sharding",
                                           "node-local", "--tensor-model-parallel-size", "2"])
    runs["bad ids"] = _prepare(pstate, ["--data-path", f"{root}/bad"])
    runs["unwritable"] = _prepare(pstate, ["--data-path", f"{root}/a",
                                           "--data-cache-path", f"{root}/file/cache"])
    if pstate.rank == 0:  # a preparer stuck 3 s past the barrier's 1.5 s timeout: last, since
        time.sleep(4.5)  # the others' unfinished barrier would meet the next collective
        runs["stuck"] = ("", None)
    else:
        runs["stuck"] = _prepare(pstate, ["--data-path", f"{root}/a", "--data-cache-path",
                                          str(root_path / "cache2"),
                                          "--distributed-timeout-minutes", "0.025"])
    return runs


def _lines(outputs: list[tuple[str, str | None]], what: str) -> list[str]:
    return [line for out, _ in outputs for line in out.splitlines() if what in line]


def test_one_rank_prepares_for_the_others(tmp_path):
    """4 gloo ranks as TP 2 x DP 2: in global mode rank 0 validates and indexes, the others
    memory-map; a restart redoes nothing; node-local: ranks 0 and 2 (one per DP rank's shard
    set on the node); a preparer's error or delay reaches every rank, by name."""
    for name in ("a", "b"):
        bare_shard(tmp_path / name, seed=ord(name))
    bare_shard(tmp_path / "bad", top=500)  # ids beyond --vocab-size 97
    (tmp_path / "file").write_text("")
    entries = []
    for s in range(2):
        bare_shard(Path(shard_name(tmp_path / "c", s)), seed=s)
        entries.append({"prefix": Path(shard_name(tmp_path / "c", s)).name})
    tokens = [fmt.IndexedShard(shard_name(tmp_path / "c", s)).num_tokens for s in range(2)]
    write_manifest(tmp_path / "c.manifest.json", {
        "shards": entries, "total_documents": 60, "total_tokens": sum(tokens),
        "tokenizer": {"vocab_size": VOCAB, "eod_id": VOCAB - 1}})
    ranks = run_ranks(_scenarios, 4, tmp_path, tp=2, root=str(tmp_path))
    runs = {name: [r[name] for r in ranks] for name in ranks[0]}

    assert [err for _, err in runs["fresh"]] == [None] * 4
    scanned, built = _lines(runs["fresh"], "scanned"), _lines(runs["fresh"], "built index")
    assert sorted(line.split()[4] for line in scanned) == [str(tmp_path / n) for n in "ab"]
    assert len(built) == 2 and all(line.startswith("data: rank 0 ") for line in scanned + built)
    assert not _lines(runs["restart"], "scanned") and not _lines(runs["restart"], "built")

    assert [err for _, err in runs["node-local"]] == [None] * 4
    assert sorted(line.split()[2] for line in _lines(runs["node-local"], "built")) == ["0", "2"]
    assert sorted(line.split()[2] for line in _lines(runs["node-local"], "scanned")) == ["0", "2"]

    errors = [err for _, err in runs["bad ids"]]
    assert "token id" in errors[0] and "outside the vocabulary" in errors[0]
    assert all(err.startswith("data: stopping, as rank 0 could not prepare the data: ")
               and str(tmp_path / "bad.bin") in err for err in errors[1:]), errors
    errors = [err for _, err in runs["unwritable"]]
    assert "set --data-cache-path to a writable directory" in errors[0], errors[0]
    assert all("rank 0 could not prepare the data" in err and "--data-cache-path" in err
               for err in errors[1:])

    for _, err in runs["stuck"][1:]:
        assert err is not None and "waited at the start-up barrier for rank 0" in err, err
        assert "--distributed-timeout-minutes" in err
