"""The pipeline engine on gloo ranks against a plain single-process loop over the same batches.

Each rank builds only its own chunks, runs its schedule, finalizes gradients (DP sum from the
engine's per-chunk hook, SP norms over TP, tied embeddings over the embedding group) and takes
SGD steps. Both sides run in float64, so losses (every step) and step-0 gradients must match
the unpipelined model to `EXACT` (1e-10): measured worst float64 errors are 0 on losses and
8e-16 on gradients (TP=2 x PP=2; 2e-16 without TP), only the summation order differs (DP/TP
all-reduces, the per-chunk and tied-embedding sums).

Spawning dominates the cost on a small CPU box, so one 4-rank spawn runs every 4-rank layout
one after the other (`relayout`): 1F1B, interleaved and ZB-H1/ZBV at PP=2 x DP=2, 1F1B and
ZB-H1/ZBV at PP=4, TP=2 x PP=2 with SP, the stage-0 memory probe and two planted breakages;
one 8-rank spawn runs TP=2 x PP=2 x DP=2. Each test reads its runs from the module fixture.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.init import shard_full
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.pipeline import engine
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import StageComm, boundary_shape
from megatron_lite.pipeline.partition import partition_layers, stage_chunks, v_partition
from megatron_lite.pipeline.schedule import BackwardWeight, schedule_chunks, stage_schedule
from tests.checkpoint.common import relayout
from tests.distributed import run_ranks
from tests.numerics import EXACT, rel_err

MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=24, seq_length=8, vocab_size=101, make_vocab_size_divisible_by=4)
MBS, LR, SEED, STEPS = 2, 0.5, 7, 3
DTYPE = torch.float64


def _global_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches with a random loss mask; two alternating batches, so the model can
    fit them and the loss curve falls."""
    g = torch.Generator().manual_seed(1000 + step % 2)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, MODEL["vocab_size"], (MBS, MODEL["seq_length"] + 1), generator=g)
        mask = (torch.rand(MBS, MODEL["seq_length"], generator=g) > 0.2).to(DTYPE)
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
            comms.all_reduce_(p.grad, pstate.tp_group, kind="tp")
        if tags.is_shared_embedding(p) and pstate.pp_size > 1:
            comms.all_reduce_(p.grad, pstate.embedding_group, kind="embedding")


def _build_chunks(cfg: ModelConfig, pstate: ParallelState, v: int, kind: str | None,
                  ctx: LayerContext) -> tuple[list[LlamaChunk], list]:
    """This stage's chunks for the schedule, the way training.build_model builds them."""
    if kind == "zbv":
        specs = stage_chunks(v_partition(cfg.num_layers, pstate.pp_size), pstate.pp_rank)
    else:
        lpv = cfg.num_layers // (pstate.pp_size * v) if v > 1 else None
        specs = stage_chunks(partition_layers(cfg.num_layers, pstate.pp_size, lpv),
                             pstate.pp_rank)
    ctx = replace(ctx, split_backward=kind in ("zb-h1", "zbv"))
    chunks: list[LlamaChunk] = []
    v_shape = kind == "zbv"
    for s in specs:
        tied = chunks[0].embedding.weight if v_shape and s.post_process else None
        chunks.append(LlamaChunk(cfg, ctx, s.layer_ids, pre_process=s.pre_process,
                                 post_process=s.post_process,
                                 head_on_stage=v_shape and s.pre_process, tied_embedding=tied))
    return chunks, specs


@dataclass(frozen=True)
class Run:
    """One training run of the spawn: a layout, a schedule and (optionally) a planted bug."""

    tp: int
    pp: int
    v: int = 1
    kind: str | None = None
    microbatches: int = 4
    sp: bool = False
    num_layers: int = MODEL["num_layers"]
    breakage: str | None = None
    """"swap-interleaved": the last virtual stage (chunk 1 of stage 1) computes micro-batch 0's
    loss with micro-batch 1's labels and mask and the other way round; "drop-w": stage 0 skips
    the deferred weight-gradient step W of micro-batch 1 (its queued GEMMs are discarded)."""


def _planted(breakage: str | None, pstate: ParallelState):
    """A patch of the engine, inside this rank, that plants `breakage` (see `Run`)."""
    if breakage == "swap-interleaved" and pstate.pp_rank == pstate.pp_size - 1:
        real = engine._forward

        def swapped(op, chunks, microbatches, *args):
            if op.chunk == 1 and op.microbatch in (0, 1):
                order = list(microbatches)
                order[0], order[1] = order[1], order[0]
                microbatches = order
            return real(op, chunks, microbatches, *args)

        return mock.patch.object(engine, "_forward", swapped)
    if breakage == "drop-w" and pstate.pp_rank == 0:
        real_w = engine._backward_weight

        def dropped(op: BackwardWeight, chunk, state) -> None:
            if op.microbatch == 1:
                for _ in engine._queue(chunk).pop(op.microbatch):
                    pass  # computed and discarded, never accumulated
                return
            real_w(op, chunk, state)

        return mock.patch.object(engine, "_backward_weight", dropped)
    return mock.patch.object(engine, "_forward", engine._forward)  # no-op patch


def _train(pstate: ParallelState, run: Run, steps: int = STEPS) -> dict:
    cfg = ModelConfig(**{**MODEL, "num_layers": run.num_layers})
    v = schedule_chunks(run.kind, run.v) if run.kind else run.v
    chunks, specs = _build_chunks(cfg, pstate, v, run.kind, LayerContext.from_state(
        pstate, seed=SEED, sequence_parallel=run.sp, dtype=DTYPE))
    actions = stage_schedule(pstate.pp_size, pstate.pp_rank, run.microbatches, v, kind=run.kind)
    shape = boundary_shape(cfg.seq_length, MBS, cfg.hidden_size, pstate.tp_size, run.sp)
    comm = StageComm(pstate, shape, DTYPE) if pstate.pp_size > 1 else None
    params = _unique_params(chunks)
    hooks: list[int] = []
    uses = Counter(id(p) for c in chunks for p in c.parameters())  # ZBV: tied weight in both
    ready: Counter = Counter()

    def dp_reduce(chunk: int) -> None:
        """The per-chunk hook: DP sum of that chunk's grads; a weight two chunks of the stage
        share (ZBV's tied embedding and head) once, at the later chunk's hook."""
        hooks.append(chunk)
        for p in chunks[chunk].parameters():
            ready[id(p)] += 1
            if ready[id(p)] % uses[id(p)] == 0:
                comms.all_reduce_(p.grad, pstate.dp_group, kind="dp")

    losses, grads = [], {}
    for step in range(steps):
        full = _global_batch(step, run.microbatches * pstate.dp_size)
        batches = full[pstate.dp_rank * run.microbatches:(pstate.dp_rank + 1) * run.microbatches]
        num_tokens = sum(b["loss_mask"].sum() for b in full)
        for p in params:
            p.grad = None
        with _planted(run.breakage, pstate):
            out = forward_backward(chunks, actions, batches, comm, _loss_fn(num_tokens),
                                   on_grads_ready=dp_reduce)
        _finalize(params, pstate)
        owner = any(c.post_process for c in chunks) and pstate.tp_rank == 0
        loss = torch.stack(out).sum() if owner else torch.zeros((), dtype=DTYPE)
        losses.append(comms.all_reduce_(loss, pstate.world_group, kind="world").item())
        if step == 0:
            grads = {_canonical(n, s.layer_ids): (p.grad.clone(), tags.tp_split(p))
                     for c, s in zip(chunks, specs) for n, p in c.named_parameters()}
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return {"losses": losses, "grads": grads, "hooks": hooks, "tp_rank": pstate.tp_rank,
            "tp": pstate.tp_size, "chunks": v}


def _reference(microbatches: int, num_layers: int = MODEL["num_layers"],
               steps: int = STEPS) -> dict:
    """The whole model in this process, a plain loop over every micro-batch of each step."""
    pstate = single_process_state()
    cfg = ModelConfig(**{**MODEL, "num_layers": num_layers})
    model = LlamaChunk(cfg, LayerContext.from_state(pstate, seed=SEED, dtype=DTYPE),
                       range(cfg.num_layers), pre_process=True, post_process=True)
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
    assert losses[-1] < losses[0]  # the curve being compared actually moves (same batch)
    return {"losses": losses, "grads": grads}


def _errors(ranks: list[dict], ref: dict) -> dict[str, float]:
    """Worst relative error over ranks of the losses (all steps) and step-0 gradients."""
    loss_err = grad_err = 0.0
    for out in ranks:
        loss_err = max(loss_err, rel_err(out["losses"], ref["losses"]))
        for name, (grad, split) in out["grads"].items():
            full = ref["grads"][name]
            padded_rows = tags.padded_vocab_size(split)
            if padded_rows is not None:  # padding depends on the TP size
                padded = torch.zeros(padded_rows, *full.shape[1:], dtype=full.dtype)
                padded[:full.size(0)] = full[:padded.size(0)]
                full = padded
            expected = shard_full(full, split, out["tp"], out["tp_rank"])
            grad_err = max(grad_err, rel_err(grad, expected))
    return {"losses": loss_err, "grads": grad_err}


def _check(ranks: list[dict], ref: dict, what: str) -> dict[str, float]:
    errors = _errors(ranks, ref)
    for kind, err in errors.items():
        assert err <= EXACT, f"{what} {kind}: relative error {err:.3e} > {EXACT:.0e}"
    return errors


def _check_hooks(ranks: list[dict], steps: int = STEPS) -> None:
    for out in ranks:  # the DP hook ran once per chunk per step (after its last W in ZB)
        assert sorted(out["hooks"]) == sorted(list(range(out["chunks"])) * steps)


class _Tracked(nn.Module):
    """Wraps a chunk and records, at each forward, how many earlier outputs are still alive."""

    def __init__(self, inner: LlamaChunk, log: dict) -> None:
        super().__init__()
        self.inner, self.log = inner, log
        self.pre_process, self.post_process = inner.pre_process, inner.post_process

    def forward(self, x, labels=None, batch=None):
        out = self.inner(x, labels, batch)
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
    ctx = LayerContext.from_state(pstate, seed=SEED, dtype=DTYPE)
    chunks = [_Tracked(LlamaChunk(cfg, ctx, s.layer_ids, pre_process=s.pre_process,
                                  post_process=s.post_process), log)
              for s in specs]
    comm = StageComm(pstate, boundary_shape(cfg.seq_length, MBS, cfg.hidden_size, 1, False),
                     DTYPE)
    batches = _global_batch(0, microbatches)
    actions = stage_schedule(pstate.pp_size, pstate.pp_rank, microbatches, v)
    forward_backward(chunks, actions, batches, comm, _loss_fn(torch.tensor(1.0)))
    return {"peak": log["peak"], "unfreed": log["unfreed"], "stage": pstate.pp_rank}


ZERO_BUBBLE = ("zb-h1", "zbv")
FOUR_RANKS = {
    "pp2dp2-1f1b": Run(1, 2), "pp2dp2-interleaved": Run(1, 2, v=2),
    **{f"pp2dp2-{k}": Run(1, 2, kind=k) for k in ZERO_BUBBLE},
    "pp4-1f1b": Run(1, 4), **{f"pp4-{k}": Run(1, 4, kind=k, microbatches=8, num_layers=8)
                              for k in ZERO_BUBBLE},
    "tp2pp2-sp-1f1b": Run(2, 2, microbatches=2, sp=True),
    # fewer micro-batches than stages (Megatron runs them; the pipeline mostly idles)
    "pp4-few-1f1b": Run(1, 4, microbatches=1),
    **{f"pp4-few-{k}": Run(1, 4, kind=k, microbatches=2, num_layers=8) for k in ZERO_BUBBLE},
    **{f"tp2pp2-sp-{k}": Run(2, 2, kind=k, sp=True) for k in ZERO_BUBBLE},
    "broken-interleaved": Run(1, 2, v=2, breakage="swap-interleaved"),
    "broken-zb-h1": Run(1, 2, kind="zb-h1", breakage="drop-w"),
}
"""name -> run, all in one 4-rank spawn."""
EIGHT_RANKS = {"tp2pp2dp2-1f1b": Run(2, 2, microbatches=2)}
MEMORY_MICROBATCHES = 8


def _spawn(pstate: ParallelState, runs: dict[str, Run], memory: bool) -> dict:
    out = {name: _train(relayout(pstate, run.tp, run.pp), run) for name, run in runs.items()}
    if memory:  # stage 0 of PP=2 (x DP=2): 1F1B and interleaved
        pp2 = relayout(pstate, 1, 2)
        out["memory"] = [_stage0_memory(pp2, v, MEMORY_MICROBATCHES) for v in (1, 2)]
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict[str, list]:
    """name -> per-rank results of the 4-rank spawn (the quick tests need only this one)."""
    ranks = run_ranks(_spawn, 4, tmp_path_factory.mktemp("engine4"), runs=FOUR_RANKS,
                      memory=True, timeout=300)
    return {name: [r[name] for r in ranks] for name in [*FOUR_RANKS, "memory"]}


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> dict[str, list]:
    ranks = run_ranks(_spawn, 8, tmp_path_factory.mktemp("engine8"), runs=EIGHT_RANKS,
                      memory=False, timeout=300)
    return {name: [r[name] for r in ranks] for name in EIGHT_RANKS}


def _world(name: str) -> int:
    return 8 if name in EIGHT_RANKS else 4


def _check_named(runs: dict, names: list[str]) -> None:
    for name in names:
        run = {**FOUR_RANKS, **EIGHT_RANKS}[name]
        dp = _world(name) // (run.tp * run.pp)
        ranks = runs[name]
        _check(ranks, _reference(run.microbatches * dp, run.num_layers), name)
        _check_hooks(ranks)


@pytest.mark.quick
def test_1f1b_matches_single_process(four) -> None:
    """1F1B at PP=2 x DP=2 and PP=4 (also with one micro-batch): every loss and gradient of
    the single process."""
    _check_named(four, ["pp2dp2-1f1b", "pp4-1f1b", "pp4-few-1f1b"])


@pytest.mark.quick
def test_interleaved_matches_single_process(four) -> None:
    """Interleaved 1F1B (v=2 chunks per stage, the wrap from the last stage to stage 0)."""
    _check_named(four, ["pp2dp2-interleaved"])


def test_tp_pp_dp_matches_single_process(four, eight) -> None:
    """TP=2 x PP=2 with SP (norm gradients over TP) and TP=2 x PP=2 x DP=2."""
    _check_named(four | eight, ["tp2pp2-sp-1f1b", "tp2pp2dp2-1f1b"])


def test_live_activations_on_stage0_stay_within_1f1b_bound(four) -> None:
    pp = 2
    stage0 = [r for r in four["memory"] if r[0]["stage"] == 0]
    assert len(stage0) == 2  # the two DP replicas of stage 0
    for plain, interleaved in stage0:
        assert plain["peak"] == pp  # 1F1B: p micro-batches in flight on stage 0, not all 8
        assert interleaved["peak"] == (pp - 1) * 2 + pp + 1  # warm-up + 1 chunk outputs
        # Every earlier output had been sent and its storage released by the next forward.
        assert plain["unfreed"] == 0 and interleaved["unfreed"] == 0


@pytest.mark.parametrize("layout", [pytest.param("pp2dp2", marks=pytest.mark.quick), "pp4",
                                    "tp2pp2-sp", "pp4-few"])
def test_zero_bubble_schedules_match_single_process(four, layout: str) -> None:
    """ZB-H1 and ZBV (B/W split, W's in the bubbles; ZBV's V with the tied embedding and head
    on stage 0) give the single process's losses and gradients; each chunk's DP hook runs
    once per step, after its last W."""
    _check_named(four, [f"{layout}-{kind}" for kind in ZERO_BUBBLE])


@pytest.mark.parametrize(("broken", "intact"), [
    pytest.param("broken-interleaved", "pp2dp2-interleaved", marks=pytest.mark.quick),
    ("broken-zb-h1", "pp2dp2-zb-h1")])
def test_planted_breakage_fails_the_comparison(four, broken: str, intact: str) -> None:
    """The comparison can fail: swapping two micro-batches on the interleaved schedule's last
    virtual stage, or dropping one deferred W step of ZB-H1, moves the numbers far past
    EXACT while the intact run passes (measured: swap 1.2e-3 on the losses, 1.5 on the
    step-0 gradients; dropped W 1.8e-3 on the losses, 0.60 on the gradients)."""
    ref = _reference(FOUR_RANKS[broken].microbatches * 2)
    _check(four[intact], ref, intact)
    errors = _errors(four[broken], ref)
    assert max(errors.values()) > 1e-6, errors
    with pytest.raises(AssertionError, match="relative error"):
        _check(four[broken], ref, broken)
