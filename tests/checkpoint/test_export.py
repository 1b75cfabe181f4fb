"""HF export of an untied model with sharded safetensors (the TP=2 tied export reuses a
checkpoint of test_layouts' spawn). fp32 training (the export writes fp32, and the import
must give back the checkpoint's weights bit for bit); the logits comparison runs in float64."""

from __future__ import annotations

import json

import pytest

from megatron_lite.export import single_process_state
from tests.checkpoint.common import FP32_FLAGS, check_hf_round_trip, run_train

pytest.importorskip("transformers")


@pytest.mark.quick
def test_untied_sharded_export(tmp_path) -> None:
    ckpt = tmp_path / "ck"
    run_train(single_process_state(), ["--num-layers", "2", "--train-iters", "2",
                                       "--untie-embeddings-and-output-weights",
                                       "--save", str(ckpt)], FP32_FLAGS)
    hf = check_hf_round_trip(ckpt, 2, tmp_path, "--max-shard-size", "30KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((hf / s).is_file() for s in shards)
    assert "lm_head.weight" in index["weight_map"]
