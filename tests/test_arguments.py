"""The CLI surface is frozen: adding or renaming a flag updates the snapshot on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_lite.arguments import all_flags, build_parser, parse_config

SNAPSHOT = Path(__file__).parent / "assets" / "cli_flags.json"


@pytest.mark.quick
def test_flag_snapshot() -> None:
    """Regenerate with: python -c "import json; from megatron_lite.arguments import all_flags;
    print(json.dumps(all_flags(), indent=1))" > tests/assets/cli_flags.json"""
    assert all_flags() == json.loads(SNAPSHOT.read_text())


def test_megatron_names_and_help_render() -> None:
    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--micro-batch-size", "--global-batch-size",
                 "--num-query-groups", "--untie-embeddings-and-output-weights", "--log-jsonl"):
        assert flag in text


def test_types_and_booleans() -> None:
    cfg = parse_config(["--lr", "1e-3", "--bf16", "--data-path", "0.3", "a", "0.7", "b",
                        "--num-layers", "3"])
    assert cfg.optim.lr == 1e-3 and cfg.train.bf16 is True and cfg.model.num_layers == 3
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert parse_config([]).train.bf16 is False
