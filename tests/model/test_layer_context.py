"""The layers' two context objects: what a LayerContext resolves once, what a BatchContext
carries, and that no layer or block is handed the whole ParallelState any more."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import replace

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.layers.context import BatchContext, LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import single_process_state
from tests.conftest import ROOT

MODEL = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=24, vocab_size=40, seq_length=8,
                    max_position_embeddings=8)


@pytest.mark.quick
def test_context_is_resolved_once_and_frozen() -> None:
    one = single_process_state()
    ctx = LayerContext.from_state(one, seed=5, sequence_parallel=True, split_backward=True)
    assert (ctx.sequence_parallel, ctx.ring, ctx.tp_size, ctx.seed) == (False, None, 1, 5)
    two = LayerContext.from_state(replace(one, tp_size=2), seed=5, sequence_parallel=True)
    assert two.sequence_parallel
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seed = 6  # type: ignore[misc]
    # each chunk gets its own weight-gradient queue, and only under split backward
    first, second = ctx.for_chunk(), ctx.for_chunk()
    assert first.weight_grads is not None and first.weight_grads is not second.weight_grads
    assert two.for_chunk().weight_grads is None and ctx.weight_grads is None


def test_batch_context_of_a_microbatch_and_the_plain_positions() -> None:
    """The context takes the micro-batch's sequence entries only, and explicit positions
    0..s-1 give bitwise the losses of no context at all (the fast path's default)."""
    index = torch.arange(MODEL.seq_length)
    batch = BatchContext.of({"tokens": index, "token_index": index, "positions": None})
    assert batch.token_index is index and batch.documents is None and batch.plan is None
    chunk = LlamaChunk(MODEL, LayerContext.from_state(single_process_state(), seed=1,
                                                      dtype=torch.float64),
                       range(MODEL.num_layers), pre_process=True, post_process=True)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_length),
                           generator=torch.Generator().manual_seed(0))
    plain = chunk(tokens, tokens)
    positions = BatchContext(positions=index.expand(2, -1).clone())
    assert torch.equal(chunk(tokens, tokens, BatchContext(token_index=index)), plain)
    assert torch.equal(chunk(tokens, tokens, positions), plain)
    shifted = BatchContext(positions=index.roll(1).expand(2, -1))
    assert not torch.equal(chunk(tokens, tokens, shifted), plain)  # positions are read


def test_host_value_is_the_stand_in_on_meta_only() -> None:
    assert comms.host_value(torch.tensor([1.0, 2.0]), None) == [1.0, 2.0]
    assert comms.host_value(torch.tensor(True), False) is True
    assert comms.host_value(torch.zeros(2, device="meta"), "dry") == "dry"


def test_no_layer_or_block_takes_the_parallel_state() -> None:
    """No module's constructor in layers/ or model/llama.py has a ParallelState parameter
    (LayerContext.from_state reads one, to build the context; the step-level MoEStep is no
    module)."""
    files = [*sorted((ROOT / "megatron_lite" / "layers").glob("*.py")),
             ROOT / "megatron_lite" / "model" / "llama.py"]
    found, modules = [], 0
    for path in files:
        for cls in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(cls, ast.ClassDef)
                    and any("Module" in ast.unparse(base) for base in cls.bases)):
                continue
            modules += 1
            for init in cls.body:
                if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                    args = init.args.args + init.args.kwonlyargs
                    found += [f"{path.name}:{init.lineno}" for arg in args if arg.annotation
                              and "ParallelState" in ast.unparse(arg.annotation)]
    assert modules >= 10 and not found, found
