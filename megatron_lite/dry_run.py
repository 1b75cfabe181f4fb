"""`pretrain.py --dry-run`: a layout checked before any GPU is rented.

Without --dry-run-ranks: the planner's view (rank grid, partition, bytes per stage), no
tensors. With --dry-run-ranks R...: for each listed rank, in this one process, that rank's real
objects are built on the meta device under a fake process group of --world-size ranks (model
chunks, gradient buffers, optimizer with its ZeRO-1 shards, mock batches of the real shapes)
and one real training step runs through them: the schedule, the engine, gradient
finalization, clipping, the optimizer step, the parameter gather, then the checkpoint-state
assembly. The same code as a real run; meta tensors carry shapes and no values, so a 70B rank
costs seconds and no memory.

What it shows per rank: the bytes of the real allocations (parameters, gradients, optimizer
state, peak activations of the step) beside the planner's, every collective and p2p op
(refused when a tensor is not on the run's device, as NCCL would), and, with
`--dry-run-ranks all`, whether the ranks' ops match (`parallel/audit.match`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from torch.utils._python_dispatch import _disable_current_modes

from megatron_lite.checkpoint import Checkpointer
from megatron_lite.config import Config, dry_run_rank_list, validate
from megatron_lite.data.builder import build_data_loaders
from megatron_lite.kernels import resolve_use_triton
from megatron_lite.memory import LiveBytes, dry_run_report, fmt_bytes
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.audit import CommAudit, CommOp, match
from megatron_lite.parallel.host_syncs import HostSyncCounter
from megatron_lite.planner import Cluster, Layout, _recompute_from, estimate_memory, evaluate
from megatron_lite.training import StepRunner, build_model, train_step

JSONL_KEYS = ("rank", "pp_rank", "tp_rank", "dp_rank", "params_bytes", "grads_bytes",
              "optimizer_bytes", "activation_bytes", "planner_params_bytes",
              "planner_grads_bytes", "planner_optimizer_bytes", "planner_activation_bytes",
              "collectives", "p2p_ops", "comm_bytes", "group_creations", "host_syncs_per_step",
              "host_step_s")
"""The fields of one `--log-jsonl` record per dry-run rank, in order."""


@dataclass
class RankResult:
    """What one rank's dry run measured (bytes) and predicted (planner_*)."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    planner_params_bytes: int
    planner_grads_bytes: int
    planner_optimizer_bytes: int
    planner_activation_bytes: int
    collectives: int
    p2p_ops: int
    comm_bytes: int
    save_growth_bytes: int
    """Device bytes allocated while the checkpoint state is assembled (should be 0)."""
    seconds: float
    ops: list[CommOp]
    group_creations: int = 0
    """Process-group creations this rank took part in at start-up (parallel/state.py)."""
    nccl_group_creations: int = 0
    """The same under NCCL with a bound device, where each is a world-wide split per kind."""
    host_syncs_per_step: int = 0
    """Device->host syncs of the training step (`host_syncs.HostSyncCounter`)."""
    host_step_s: float = 0.0
    """Host seconds of a second step with every recording mode off: the Python floor."""
    host_syncs_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self) -> dict:
        return {k: getattr(self, k) for k in JSONL_KEYS}


def _mock_config(cfg: Config) -> Config:
    """The run's config reading mock batches on the calling thread (a dry run reads no data;
    mock samples have no documents, which change attention's work but not its memory)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, mock_data=True, num_workers=0, reset_position_ids=False,
        reset_attention_mask=False))


def run_rank(cfg: Config, world_size: int, rank: int) -> RankResult:
    """Build rank `rank` of a `world_size` job on meta and run one training step."""
    start = time.perf_counter()
    validate(cfg, world_size)
    pstate = parallel_state.initialize_fake(cfg, world_size, rank)
    try:
        audit, live = CommAudit(pstate.device), LiveBytes(pstate.device)
        with audit, live:
            chunks = build_model(cfg, pstate)
            optimizer = Optimizer(cfg, chunks, pstate)
            try:
                loader, _ = build_data_loaders(_mock_config(cfg), pstate.dp_rank, pstate.dp_size,
                                               cp_rank=pstate.cp_rank)
                runner = StepRunner(cfg, pstate, chunks, on_grads_ready=optimizer.start_grad_sync)
                params = live.bytes_of(optimizer.param_tensors())
                grads = live.bytes_of(optimizer.grad_tensors())
                states = live.bytes_of([t for s in optimizer.shards
                                        for t in (s.master, s.exp_avg, s.exp_avg_sq)])
                before = live.reset_peak()
                with HostSyncCounter() as syncs:
                    train_step(runner, optimizer, loader, pstate, cfg.optim.lr)
                activations = live.peak - before
                before = live.reset_peak()
                Checkpointer(cfg, pstate, chunks, optimizer, loader).snapshot()
                save_growth = live.peak - before
                host_step_s = _host_step_seconds(runner, optimizer, loader, pstate, cfg)
            finally:
                optimizer.close()
        est = estimate_memory(cfg, world_size, stage=pstate.pp_rank,
                              fused_kernels=resolve_use_triton(cfg.model.triton_kernels,
                                                               pstate.device))
        p2p = [op for op in audit.ops if op.op in ("send", "recv")]
        return RankResult(
            rank, pstate.pp_rank, pstate.tp_rank, pstate.dp_rank, params, grads, states,
            activations, est.param_bytes, est.grad_bytes, est.optimizer_bytes,
            int(est.activation_bytes), len(audit.ops) - len(p2p), len(p2p),
            sum(op.nbytes for op in audit.ops), save_growth, time.perf_counter() - start,
            audit.ops, pstate.group_creations,
            parallel_state.planned_creations(_group_lists(cfg, world_size), rank, world_size,
                                             split=True),
            syncs.total, host_step_s, dict(syncs.by_kind))
    finally:
        parallel_state.destroy(pstate)


def _host_step_seconds(runner: StepRunner, optimizer: Optimizer, loader, pstate,
                       cfg: Config) -> float:
    """One more training step with the recording modes off: what the host alone takes to
    issue a step (on meta no kernel runs, so this is the Python floor of a GPU step). Only
    a sync counter stays on: it is what lets a host read of a meta tensor return at all."""
    with _disable_current_modes(), HostSyncCounter():
        start = time.perf_counter()
        train_step(runner, optimizer, loader, pstate, cfg.optim.lr)
        return time.perf_counter() - start


def planner_step_s(cfg: Config, world_size: int) -> float | None:
    """The planner's step time for this layout (default cluster), None when it has none."""
    p, t = cfg.parallel, cfg.train
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    dp = world_size // (tp * pp * cp)
    try:
        chunks = (cfg.model.num_layers // pp // p.num_layers_per_virtual_pipeline_stage
                  if p.num_layers_per_virtual_pipeline_stage else 1)
        schedule = p.pipeline_schedule if p.pipeline_schedule in ("zb-h1", "zbv") else None
        layout = Layout(tp, pp, dp, chunks, t.micro_batch_size,
                        p.data_parallel_sharding_strategy, _recompute_from(cfg),
                        p.sequence_parallel, schedule, cp)
        gbs = t.global_batch_size or t.micro_batch_size * dp
        return evaluate(cfg.model, layout, Cluster(gpus=world_size), gbs, 1.0).step_s
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def host_syncs_line(r: RankResult, planner_s: float | None) -> str:
    """Syncs per step (by kind) and the host's floor beside the planner's step time."""
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.host_syncs_by_kind.items())) or "none"
    planned = f"{planner_s:.3g} s" if planner_s is not None else "-"
    return (f"dry run: rank {r.rank} step: {r.host_syncs_per_step} device->host syncs ({kinds}); "
            f"host {r.host_step_s:.3g} s per step with recording off, planner step {planned}")


def _group_lists(cfg: Config, world_size: int) -> dict[str, list[list[int]]]:
    """The groups `initialize` builds for this layout."""
    p = cfg.parallel
    return parallel_state.group_lists(parallel_state.rank_grid(
        world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
        p.context_parallel_size))


def group_creations_line(r: RankResult) -> str:
    """What start-up costs this rank in group creations, on the fake backend and on NCCL."""
    return (f"dry run: rank {r.rank} took part in {r.group_creations} process-group creations "
            f"at start-up ({r.nccl_group_creations} world splits under NCCL with device_id, "
            "one per group kind)")


def _ratio(measured: int, planned: int) -> str:
    return f"{measured / planned:.3f}" if planned else "-"


def format_table(results: list[RankResult]) -> str:
    """Per rank: measured bytes, the planner's, and their ratio; communication; timing."""
    head = (f"{'rank':>6} {'pp':>3} {'tp':>3} {'dp':>4} | {'params':>10} {'grads':>10} "
            f"{'optimizer':>10} {'activations':>11} | {'colls':>6} {'p2p':>5} {'comm':>10} | "
            f"{'save +':>7} {'s':>5}")
    lines = ["dry run on the meta device: bytes of the real allocations, the planner's, ratio",
             head, "-" * len(head)]
    for r in results:
        measured = (r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.activation_bytes)
        planned = (r.planner_params_bytes, r.planner_grads_bytes, r.planner_optimizer_bytes,
                   r.planner_activation_bytes)
        cells = [fmt_bytes(n) for n in measured]
        lines.append(
            f"{r.rank:>6} {r.pp_rank:>3} {r.tp_rank:>3} {r.dp_rank:>4} | {cells[0]:>10} "
            f"{cells[1]:>10} {cells[2]:>10} {cells[3]:>11} | {r.collectives:>6} {r.p2p_ops:>5} "
            f"{fmt_bytes(r.comm_bytes):>10} | {fmt_bytes(r.save_growth_bytes):>7} "
            f"{r.seconds:>5.1f}")
        cells = [fmt_bytes(n) for n in planned]
        lines.append(f"{'planner':>19} | {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{cells[3]:>11} |")
        cells = [_ratio(a, b) for a, b in zip(measured, planned)]
        lines.append(f"{'ratio':>19} | {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{cells[3]:>11} |")
    lines.append("activations = peak bytes allocated during the training step beyond the states; "
                 "comm = bytes handed to collectives and p2p; save + = device bytes allocated "
                 "while the checkpoint state is assembled")
    return "\n".join(lines)


def dry_run(cfg: Config, world_size: int) -> int:
    """The whole --dry-run: planner report, then the listed ranks; exit status."""
    validate(cfg, world_size)
    print(dry_run_report(cfg, world_size), flush=True)
    ranks = dry_run_rank_list(cfg, world_size)
    if not ranks:
        print("(add --dry-run-ranks 0 ... or `all` to run those ranks' real training step on "
              "the meta device)")
        return 0
    results = []
    for rank in ranks:
        results.append(run_rank(cfg, world_size, rank))
        print(f"dry run: rank {rank} done in {results[-1].seconds:.1f} s", flush=True)
        print(group_creations_line(results[-1]), flush=True)
        print(host_syncs_line(results[-1], planner_step_s(cfg, world_size)), flush=True)
    print(format_table(results))
    if cfg.logging.log_jsonl:
        with open(cfg.logging.log_jsonl, "w") as f:
            for r in results:
                f.write(json.dumps(r.record()) + "\n")
    if len(ranks) < world_size:
        print(f"collectives not matched: {len(ranks)} of {world_size} ranks were dry-run "
              "(--dry-run-ranks all matches them)")
        return 0
    problem = match({r.rank: r.ops for r in results})
    if problem:
        print(f"collectives DO NOT match: {problem}")
        return 1
    print(f"collectives matched: {sum(len(r.ops) for r in results)} ops on {world_size} ranks")
    return 0
