"""The pipeline engine on gloo ranks against a plain single-process loop over the same batches.

Each rank builds only its own chunks, runs its schedule, finalizes gradients (DP sum from the
engine's per-chunk hook, SP norms over TP, tied embeddings over the embedding group) and takes
SGD steps; losses and gradients must match the unpipelined model to fp32 precision.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import replace

import pytest
import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.layers import tags
from megatron_lite.layers.init import shard_full
from megatron_lite.model.llama import BuildOptions, LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import StageComm, boundary_shape
from megatron_lite.pipeline.partition import partition_layers, stage_chunks, v_partition
from megatron_lite.pipeline.schedule import schedule_chunks, stage_schedule
from tests.distributed import run_ranks

MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, seq_length=8, vocab_size=101, make_vocab_size_divisible_by=4)
MBS, LR, SEED = 2, 0.5, 7


def _global_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches with a random loss mask; two alternating batches, so the model can
    fit them and the loss curve falls."""
    g = torch.Generator().manual_seed(1000 + step % 2)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, MODEL["vocab_size"], (MBS, MODEL["seq_length"] + 1), generator=g)
        mask = (torch.rand(MBS, MODEL["seq_length"], generator=g) > 0.2).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def _loss_fn(num_tokens: torch.Tensor):
    return lambda per_token, b: (per_token * b["loss_mask"]).sum() / num_tokens


def _canonical(name: str, layer_ids: tuple[int, ...]) -> str:
    """Chunk-local parameter name -> whole-model name (layers.<local> -> layers.<global>)."""
    name = re.sub(r"^layers\.(\d+)\.", lambda match: f"layers.{layer_ids[int(match[1])]}.", name)
    # the tied copy, or (ZBV) the head's reference to the same stage's embedding
    return "embedding.weight" if name in ("output.weight", "output.shared_weight") else name


def _unique_params(chunks: list[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for c in chunks for p in c.parameters()}.values())


def _finalize(params: list[nn.Parameter], pstate: ParallelState) -> None:
    for p in params:
        if tags.is_sequence_parallel_grad(p):
            comms.all_reduce_(p.grad, pstate.tp_group)
        if tags.is_shared_embedding(p) and pstate.pp_size > 1:
            comms.all_reduce_(p.grad, pstate.embedding_group)


def _build_chunks(cfg: ModelConfig, pstate: ParallelState, v: int, kind: str | None,
                  opts: BuildOptions) -> tuple[list[LlamaChunk], list]:
    """This stage's chunks for the schedule, the way training.build_model builds them."""
    if kind == "zbv":
        specs = stage_chunks(v_partition(cfg.num_layers, pstate.pp_size), pstate.pp_rank)
    else:
        lpv = cfg.num_layers // (pstate.pp_size * v) if v > 1 else None
        specs = stage_chunks(partition_layers(cfg.num_layers, pstate.pp_size, lpv),
                             pstate.pp_rank)
    opts = replace(opts, split_backward=kind in ("zb-h1", "zbv"))
    chunks: list[LlamaChunk] = []
    v_shape = kind == "zbv"
    for s in specs:
        tied = chunks[0].embedding.weight if v_shape and s.post_process else None
        chunks.append(LlamaChunk(cfg, pstate, s.layer_ids, pre_process=s.pre_process,
                                 post_process=s.post_process, opts=opts,
                                 head_on_stage=v_shape and s.pre_process, tied_embedding=tied))
    return chunks, specs


def _train(pstate: ParallelState, v: int, microbatches: int, steps: int, sp: bool,
           kind: str | None = None, num_layers: int = MODEL["num_layers"]) -> dict:
    cfg = ModelConfig(**{**MODEL, "num_layers": num_layers})
    v = schedule_chunks(kind, v) if kind else v
    chunks, specs = _build_chunks(cfg, pstate, v, kind, BuildOptions(seed=SEED,
                                                                     sequence_parallel=sp))
    actions = stage_schedule(pstate.pp_size, pstate.pp_rank, microbatches, v, kind=kind)
    shape = boundary_shape(cfg.seq_length, MBS, cfg.hidden_size, pstate.tp_size, sp)
    comm = StageComm(pstate, shape, torch.float32) if pstate.pp_size > 1 else None
    params = _unique_params(chunks)
    hooks: list[int] = []

    def dp_reduce(chunk: int) -> None:  # the per-chunk hook: DP sum of that chunk's grads
        hooks.append(chunk)
        for p in chunks[chunk].parameters():
            comms.all_reduce_(p.grad, pstate.dp_group)

    losses, grads = [], {}
    for step in range(steps):
        full = _global_batch(step, microbatches * pstate.dp_size)
        batches = full[pstate.dp_rank * microbatches:(pstate.dp_rank + 1) * microbatches]
        num_tokens = sum(b["loss_mask"].sum() for b in full)
        for p in params:
            p.grad = None
        out = forward_backward(chunks, actions, batches, comm, _loss_fn(num_tokens),
                               on_grads_ready=dp_reduce)
        _finalize(params, pstate)
        owner = any(c.post_process for c in chunks) and pstate.tp_rank == 0
        loss = torch.stack(out).sum() if owner else torch.zeros(())
        losses.append(comms.all_reduce_(loss, pstate.world_group).item())
        if step == 0:
            grads = {_canonical(n, s.layer_ids): (p.grad.clone(), tags.tp_split(p))
                     for c, s in zip(chunks, specs) for n, p in c.named_parameters()}
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return {"losses": losses, "grads": grads, "hooks": hooks}


def _reference(microbatches: int, steps: int, num_layers: int = MODEL["num_layers"]) -> dict:
    """The whole model in this process, a plain loop over every micro-batch of each step."""
    pstate = single_process_state()
    cfg = ModelConfig(**{**MODEL, "num_layers": num_layers})
    model = LlamaChunk(cfg, pstate, range(cfg.num_layers), pre_process=True, post_process=True,
                       opts=BuildOptions(seed=SEED))
    losses, grads = [], {}
    for step in range(steps):
        full = _global_batch(step, microbatches)
        num_tokens = sum(b["loss_mask"].sum() for b in full)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b in full:
            loss = _loss_fn(num_tokens)(model(b["tokens"], b["labels"]), b)
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "grads": grads}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _check(ranks: list[dict], ref: dict, tp: int, check_grads: bool) -> None:
    for rank, out in enumerate(ranks):
        for step, (got, want) in enumerate(zip(out["losses"], ref["losses"])):
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: {got} {want}"
        if not check_grads:
            continue
        tp_rank = rank % tp
        for name, (grad, split) in out["grads"].items():
            full = ref["grads"][name]
            padded_rows = tags.padded_vocab_size(split)
            if padded_rows is not None:  # padding depends on the TP size
                padded = torch.zeros(padded_rows, *full.shape[1:])
                padded[:full.size(0)] = full[:padded.size(0)]
                full = padded
            expected = shard_full(full, split, tp, tp_rank)
            assert _rel_err(grad, expected) <= 1e-5, f"rank {rank}: gradient of {name} differs"


def _train_each(pstate: ParallelState, vs: tuple[int, ...], microbatches: int,
                steps: int) -> list[dict]:
    """Several schedules in one set of processes (spawning dominates the test time)."""
    return [_train(pstate, v, microbatches, steps, sp=False) for v in vs]


@pytest.mark.parametrize(("pp", "vs"), [(2, (1, 2)), (4, (1,))])
def test_pipeline_matches_single_process(tmp_path, pp: int, vs: tuple[int, ...]) -> None:
    microbatches, steps = 4, 10
    ref = _reference(microbatches, steps)
    assert ref["losses"][-1] < ref["losses"][0]  # the curve being compared actually moves
    ranks = run_ranks(_train_each, pp, tmp_path, pp=pp, vs=vs, microbatches=microbatches,
                      steps=steps)
    for i, v in enumerate(vs):
        _check([out[i] for out in ranks], ref, tp=1, check_grads=True)
        for out in ranks:  # the DP hook ran once per chunk per step
            assert sorted(out[i]["hooks"]) == sorted(list(range(v)) * steps)


@pytest.mark.parametrize(("world", "tp", "pp", "sp"), [(4, 2, 2, True), (8, 2, 2, False)])
def test_tp_pp_dp_matches_single_process(tmp_path, world: int, tp: int, pp: int,
                                         sp: bool) -> None:
    microbatches, dp = 2, world // (tp * pp)
    ref = _reference(microbatches * dp, steps=5)
    ranks = run_ranks(_train, world, tmp_path, tp=tp, pp=pp, v=1, microbatches=microbatches,
                      steps=5, sp=sp, timeout=240)
    _check(ranks, ref, tp=tp, check_grads=True)


class _Tracked(nn.Module):
    """Wraps a chunk and records, at each forward, how many earlier outputs are still alive."""

    def __init__(self, inner: LlamaChunk, log: dict) -> None:
        super().__init__()
        self.inner, self.log = inner, log
        self.pre_process, self.post_process = inner.pre_process, inner.post_process

    def forward(self, x, labels=None):
        out = self.inner(x, labels)
        alive = [tensor for tensor in (ref() for ref in self.log["refs"]) if tensor is not None]
        self.log["peak"] = max(self.log["peak"], len(alive) + 1)
        self.log["unfreed"] = max(self.log["unfreed"],
                                  sum(tensor.untyped_storage().size() > 0 for tensor in alive))
        self.log["refs"].append(weakref.ref(out))
        return out


def _stage0_memory(pstate: ParallelState, v: int, microbatches: int) -> dict:
    cfg = ModelConfig(**MODEL)
    lpv = cfg.num_layers // (pstate.pp_size * v) if v > 1 else None
    specs = stage_chunks(partition_layers(cfg.num_layers, pstate.pp_size, lpv), pstate.pp_rank)
    log = {"refs": [], "peak": 0, "unfreed": 0}
    chunks = [_Tracked(LlamaChunk(cfg, pstate, s.layer_ids, pre_process=s.pre_process,
                                  post_process=s.post_process, opts=BuildOptions(seed=SEED)), log)
              for s in specs]
    comm = StageComm(pstate, boundary_shape(cfg.seq_length, MBS, cfg.hidden_size, 1, False),
                     torch.float32)
    batches = _global_batch(0, microbatches)
    actions = stage_schedule(pstate.pp_size, pstate.pp_rank, microbatches, v)
    forward_backward(chunks, actions, batches, comm, _loss_fn(torch.tensor(1.0)))
    return {"peak": log["peak"], "unfreed": log["unfreed"]}


def _stage0_memory_each(pstate: ParallelState, microbatches: int) -> list[dict]:
    return [_stage0_memory(pstate, v, microbatches) for v in (1, 2)]


def test_live_activations_on_stage0_stay_within_1f1b_bound(tmp_path) -> None:
    pp, microbatches = 2, 8
    plain, interleaved = run_ranks(_stage0_memory_each, pp, tmp_path, pp=pp,
                                   microbatches=microbatches)[0]
    assert plain["peak"] == pp  # 1F1B: p micro-batches in flight on stage 0, not all 8
    assert interleaved["peak"] == (pp - 1) * 2 + pp + 1  # warm-up + 1 chunk outputs, not 8 x v
    # Every earlier output had been sent and its storage released by the next forward.
    assert plain["unfreed"] == 0 and interleaved["unfreed"] == 0


def _train_schedules(pstate: ParallelState, kinds: tuple[str, ...], microbatches: int,
                     steps: int, sp: bool, num_layers: int) -> list[dict]:
    return [_train(pstate, 1, microbatches, steps, sp, kind, num_layers) for kind in kinds]


ZERO_BUBBLE = ("zb-h1", "zbv")


@pytest.mark.parametrize(("world", "tp", "pp", "sp", "layers"),
                         [(2, 1, 2, False, 4), (4, 1, 4, False, 8), (4, 2, 2, True, 4)])
def test_zero_bubble_schedules_match_single_process(tmp_path, world: int, tp: int, pp: int,
                                                    sp: bool, layers: int) -> None:
    """ZB-H1 and ZBV (B/W split, W's in the bubbles; ZBV's V with the tied embedding and head
    on stage 0) give the single process's losses and gradients; each chunk's DP hook runs
    once per step, after its last W."""
    microbatches, steps = 2 * pp, 6
    ref = _reference(microbatches, steps, layers)
    ranks = run_ranks(_train_schedules, world, tmp_path, tp=tp, pp=pp, kinds=ZERO_BUBBLE,
                      microbatches=microbatches, steps=steps, sp=sp, num_layers=layers,
                      timeout=240)
    for i, kind in enumerate(ZERO_BUBBLE):
        _check([out[i] for out in ranks], ref, tp=tp, check_grads=True)
        for out in ranks:
            assert sorted(out[i]["hooks"]) == sorted(list(range(schedule_chunks(kind, 1)))
                                                     * steps)
