"""data_tools.stage: the right shards per node, checksums verified, resumable."""

from __future__ import annotations

import numpy as np
import pytest

from data_tools.stage import dp_ranks_on_node, main
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest


@pytest.fixture
def corpus(tmp_path):
    entries = []
    (tmp_path / "shared").mkdir()
    for i in range(8):
        w = ShardWriter(shard_name(tmp_path / "shared" / "c", i), np.uint16)
        w.add_documents(np.arange(i + 3), np.array([i + 3]))
        entries.append(w.finalize())
    write_manifest(tmp_path / "shared" / "c.manifest.json",
                   {"shards": entries, "total_tokens": 0, "total_documents": 8})
    return tmp_path / "shared" / "c.manifest.json"


def test_dp_ranks_on_node():
    # 2 nodes x 4 GPUs, TP=2, PP=1: dp=4; node 0 holds ranks 0-3 -> DP ranks 0, 1
    assert dp_ranks_on_node(2, 0, 4, 2, 1) == ([0, 1], 4)
    assert dp_ranks_on_node(2, 1, 4, 2, 1) == ([2, 3], 4)
    # 2 nodes x 4 GPUs, TP=4, PP=2 (PP across nodes): dp=1, both nodes need replica 0
    assert dp_ranks_on_node(2, 1, 4, 4, 2) == ([0], 1)
    # 4 nodes x 2 GPUs, TP=2, PP=2: dp=2; nodes 0,1 are stage 0; nodes 2,3 stage 1
    assert [dp_ranks_on_node(4, n, 2, 2, 2)[0] for n in range(4)] == [[0], [1], [0], [1]]


@pytest.mark.quick
def test_stage_node_shards_and_resume(corpus, tmp_path, capsys):
    local = tmp_path / "local"
    args = ["--manifest", str(corpus), "--local-dir", str(local), "--nodes", "2",
            "--node-rank", "1", "--gpus-per-node", "2"]
    main(args)  # dp=4; node 1 holds DP ranks 2, 3 -> shards 2,6 and 3,7
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted([f"c_{i:05d}.{e}" for i in (2, 3, 6, 7) for e in ("bin", "idx")]
                           + ["c.manifest.json"])
    assert (local / "c_00006.bin").read_bytes() == (corpus.parent / "c_00006.bin").read_bytes()
    assert "copied 8 files" in capsys.readouterr().out
    (local / "c_00003.bin").write_bytes(b"corrupt")
    main(args)
    out = capsys.readouterr().out
    assert "copied 1 files: c_00003.bin" in out and "skipped 7 files" in out


def test_corrupt_source_is_refused(corpus, tmp_path, capsys):
    (corpus.parent / "c_00000.idx").write_bytes(b"x")
    assert main(["--manifest", str(corpus), "--local-dir", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "c_00000.idx: checksum" in err, err
    assert not list((tmp_path / "l").glob("c_00000.idx*"))


def test_node_count_and_rank_from_slurm(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    main(["--manifest", str(corpus), "--local-dir", str(tmp_path / "l")])
    assert "node 3/4 (DP ranks [3]): shards [3, 7]" in capsys.readouterr().out
