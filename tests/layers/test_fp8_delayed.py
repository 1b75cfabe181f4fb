"""Delayed FP8 scaling (--fp8-recipe delayed, layers/fp8.py): the history window against a
hand computation, scales independent of the DP / micro-batch and TP split, one record per
forward under full recompute, and a bit-exact resume of the histories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint import CheckpointReader
from megatron_lite.layers import fp8, tags
from megatron_lite.layers.fp8 import Fp8Groups, Fp8History, Fp8Recipe, Fp8State, cast
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count, train
from tests.checkpoint.common import FP32_FLAGS, full_state
from tests.distributed import run_ranks
from tests.numerics import assert_all_close
from tests.optim.common import full_params, make_config, model_parameters, step_batches

STEPS = 3


@pytest.mark.quick
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_window_against_hand_computation(algo: str) -> None:
    """N=3, five folds of known amaxes: the history holds the last three, newest first, and
    the scale's amax is their max or the newest, as a plain list computes them."""
    recipe = Fp8Recipe("hybrid", delayed=True, history_len=3, compute_algo=algo)
    hist = Fp8History(recipe, 1, [], single_process_state())
    state = Fp8State(recipe)
    state.history, state.amax = hist.history[0], hist.amax[0]
    seen: list[list[float]] = []
    for step, value in enumerate([4.0, 1.0, 8.0, 2.0, 0.5]):
        state.observe(fp8.WEIGHT, torch.tensor(99.0))  # before the step: cleared by begin
        hist.begin()
        for micro in (value / 2, value, value / 4):  # the step's max over micro-batches
            state.observe(fp8.GRAD, torch.tensor(micro))
        state.observe(fp8.INPUT, torch.tensor(float(step + 1)))
        hist.fold()
        seen.insert(0, [float(step + 1), 0.0, value])
        window = seen[:3] + [[0.0] * 3] * (3 - len(seen[:3]))
        assert hist.history[0].tolist() == window
        grads = [row[2] for row in seen[:3]]
        want = max(grads) if algo == "max" else grads[0]
        assert state.history_amax(fp8.GRAD).item() == want


def test_started_survives_a_rank_zero_without_fp8_linears() -> None:
    """Rank 0 may hold no FP8 linear (PP with --first-last-layers-bf16), yet its state_dict is
    the one saved: after a fold it says the histories started, and loading it makes another
    rank's linears scale from their histories (not from current amaxes) at once."""
    recipe = Fp8Recipe("hybrid", delayed=True, history_len=2)
    rank0 = Fp8History(recipe, 1, [], single_process_state())
    rank0.fold()
    other = Fp8History(recipe, 1, [], single_process_state())
    state = Fp8State(recipe)
    other.states.append(state)
    other.load_state_dict(rank0.state_dict())
    assert state.started


def test_forward_scales_from_history_and_saturates() -> None:
    """Once started, the input is scaled by the history's amax (not its own): values past it
    saturate at the fp8 max; before the first fold it uses its current amax."""
    recipe = Fp8Recipe("e4m3", delayed=True)
    x, w = torch.tensor([[1.5, -6.0]]), torch.eye(2)
    state = Fp8State(recipe)
    first = fp8.Fp8Linear.apply(x, w, recipe, Fp8Groups(), state, True)
    x8, x_inv = cast(x, fp8.FWD_DTYPE, torch.tensor(6.0))
    assert torch.equal(first, (x8.float() * x_inv))  # identity weight: the dequantized input
    state.history[0, fp8.INPUT], state.started = 3.0, True
    out = fp8.Fp8Linear.apply(x, w, recipe, Fp8Groups(), state, True)
    # 3.0 maps to 448, so 1.5 to 224 (exact in e4m3) and -6 to -896: saturated at -448
    assert torch.allclose(out, torch.tensor([[1.5, -3.0]]), rtol=1e-6, atol=0)
    assert state.amax[fp8.INPUT].item() == 6.0  # recorded twice, its max


def _delayed_config(tp: int = 1, micro: int = 1, **kw: object):
    cfg = make_config(tp=tp, micro=micro, fp64=False, **kw)
    cfg.train.fp8_format, cfg.train.fp8_recipe = "hybrid", "delayed"
    cfg.train.fp8_amax_history_len, cfg.train.fp8_amax_compute_algo = 2, "max"
    return cfg


def _train(pstate: ParallelState, cfg=None, recompute: bool = False) -> dict:
    """STEPS steps of the tiny fp32 model; its weights and the amax histories."""
    cfg = cfg or _delayed_config(pstate.tp_size, pp=pstate.pp_size,
                                 sequence_parallel=pstate.tp_size > 1)
    if recompute:
        cfg.train.recompute_granularity = "full"
        cfg.train.recompute_method, cfg.train.recompute_num_layers = "uniform", 1
    chunks = build_model(cfg, pstate)
    opt, runner = Optimizer(cfg, chunks, pstate), StepRunner(cfg, pstate, chunks)
    histories = []
    for step in range(STEPS):
        batches = step_batches(step, pstate.dp_rank, pstate.dp_size, 1)
        opt.zero_grad()
        runner(batches, global_token_count(batches, pstate))
        opt.finalize_grads()
        opt.step(cfg.optim.lr)
        histories.append(runner.amax_history.history.clone())
    return {"params": model_parameters(chunks), "history": histories,
            "splits": {n: tags.tp_split(p) for n, p in chunks[0].named_parameters()}}


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Elementwise within `tol` of the larger magnitude (zero rows stay zero)."""
    scale = torch.maximum(got.abs(), want.abs()).clamp_min(1e-30)
    worst = ((got - want).abs() / scale).max().item()
    assert worst <= tol, worst


def test_dp2_equals_one_process_accumulating(tmp_path) -> None:
    """DP=2 (2 micro-batches each) and one process (4 micro-batches), 3 steps: the first
    step's history entries bit for bit (the weights are still equal), both DP ranks' always,
    later ones within 1e-5 relative (DP's fp32 gradient sums round otherwise than
    accumulation) and the weights within 1e-5."""
    ranks = run_ranks(_train, 2, tmp_path)
    ref = _train(single_process_state())
    assert torch.equal(ranks[0]["history"][0], ref["history"][0])
    assert ref["history"][0][:, 0].gt(0).sum() == 2 * 4 * 3  # layers x linears x operands
    for step in range(STEPS):
        assert torch.equal(ranks[0]["history"][step], ranks[1]["history"][step])
        _assert_close(ranks[0]["history"][step], ref["history"][step], 1e-5)
    assert ref["history"][-1][:, 1].gt(0).any()  # two steps' entries in the window
    assert_all_close(ranks[0]["params"], ref["params"], 1e-5)


def test_tp2_sp_delayed_equals_one_process(tmp_path) -> None:
    """TP=2 with SP, 3 steps: histories within 1e-5 relative of one process's (TP's split
    fp32 sums move the activations' amaxes by rounding) and weights within 1e-4. Measured:
    histories 4.7e-7, weights 3.8e-6 (DP=2 above: histories 1.5e-7 after step 1, weights
    4.1e-6)."""
    ranks = run_ranks(_train, 2, tmp_path, tp=2)
    ref = _train(single_process_state())
    assert torch.equal(ranks[0]["history"][-1], ranks[1]["history"][-1])
    _assert_close(ranks[0]["history"][-1], ref["history"][-1], 1e-5)
    assert_all_close(full_params(ranks, tp=2), ref["params"], 1e-4)


def test_pp2_every_rank_holds_every_layers_history(tmp_path) -> None:
    """PP=2 (a layer per stage): each stage fills its own layer's rows and the fold's world MAX
    gives both ranks the whole model's histories, equal on both ranks; the first step's are
    one process's bit for bit (same weights, PP splits no sum), later ones within 1e-5 (the
    fp32 weights drift by rounding: measured 1.7e-7, and with ATEN_CPU_CAPABILITY=default
    the last step's histories are not bit-exact), each stage's weights within 1e-5."""
    ranks = run_ranks(_train, 2, tmp_path, pp=2)
    ref = _train(single_process_state())
    for rank in ranks:
        assert torch.equal(rank["history"][0], ref["history"][0])
        assert torch.equal(rank["history"][-1], ranks[0]["history"][-1])
        _assert_close(rank["history"][-1], ref["history"][-1], 1e-5)
    for rank in ranks:
        assert_all_close(rank["params"], {n: ref["params"][n] for n in rank["params"]}, 1e-5)


def test_full_recompute_records_each_forward_once(monkeypatch) -> None:
    """Full recompute reruns every layer's forward in backward: the rerun observes no amax,
    so the observations and the histories are those of the run without recompute."""
    counts: list[int] = []
    observe = Fp8State.observe

    def counted(self: Fp8State, operand: int, amax: torch.Tensor) -> None:
        counts[-1] += 1
        observe(self, operand, amax)

    monkeypatch.setattr(Fp8State, "observe", counted)
    results = []
    for recompute in (False, True):
        counts.append(0)
        results.append(_train(single_process_state(), recompute=recompute))
    assert counts[0] == counts[1] == STEPS * 4 * 8 * 3  # steps x micro x linears x operands
    assert torch.equal(results[0]["history"][-1], results[1]["history"][-1])


def _final(root: Path) -> Path:
    return sorted(root.glob("iter_*"))[-1]


@pytest.mark.parametrize("gather", [
    [], ["--use-distributed-optimizer", "--fp8-param-gather"],
    ["--data-parallel-sharding-strategy", "optim_grads_params", "--fp8-param-gather"]],
    ids=["model-dtype-gather", "fp8-param-gather", "zero3-fp8-param-gather"])
def test_resume_is_bit_exact(tmp_path, gather: list[str]) -> None:
    """4 steps straight vs 2 + save + load + 2 under --fp8-recipe delayed (fp32): the same
    weights, optimizer state and amax histories, bit for bit; with --fp8-param-gather too
    (the histories are restored before the loaded weights are cast to fp8)."""
    flags = [*FP32_FLAGS, "--fp8-format", "hybrid", "--fp8-amax-history-len", "3",
             "--fp8-amax-compute-algo", "max", *gather]
    pstate = single_process_state()
    train(parse_config([*flags, "--save", str(tmp_path / "a")]), pstate)
    train(parse_config([*flags, "--save", str(tmp_path / "b"), "--exit-interval", "2"]), pstate)
    train(parse_config([*flags, "--save", str(tmp_path / "b")]), pstate)
    a, b = _final(tmp_path / "a"), _final(tmp_path / "b")
    assert a.name == b.name
    hist_a = CheckpointReader(a).meta["extra_state"]["fp8"]["amax_history"]
    hist_b = CheckpointReader(b).meta["extra_state"]["fp8"]["amax_history"]
    assert hist_a == hist_b and torch.tensor(hist_a)[:, 2].gt(0).any()
    sa, sb = full_state(a), full_state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        for kind in sa[name]:
            assert torch.equal(sa[name][kind], sb[name][kind]), (name, kind)


def _train_schedule(pstate: ParallelState, schedule: str) -> dict:
    cfg = _delayed_config(pp=pstate.pp_size, micro=1)
    cfg.parallel.pipeline_schedule = schedule
    cfg.model.num_layers = 4  # ZBV cuts 2 x pp chunks
    return _train(pstate, cfg)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_defers_the_fp8_weight_gradient(tmp_path, schedule: str) -> None:
    """PP=2 under a zero-bubble schedule: the B step returns the input gradient and queues
    the weight-gradient GEMM on the saved e4m3 operands for W. Against 1F1B: the first step's
    amax histories bit for bit; zb-h1 (1F1B's partition, the same sums) stays bit for bit,
    ZBV (a V of layers: the stages' fp32 sums differ) within 1e-5, as the weights."""
    ranks = run_ranks(_train_schedule, 2, tmp_path, pp=2, schedule=schedule)
    ref = run_ranks(_train_schedule, 2, tmp_path, pp=2, schedule="1f1b")
    assert torch.equal(ranks[0]["history"][0], ref[0]["history"][0])
    assert ranks[0]["history"][-1][:, :, fp8.GRAD].gt(0).sum() == 4 * 4 * 2
    tol = 0.0 if schedule == "zb-h1" else 1e-5
    for step in range(STEPS):
        _assert_close(ranks[0]["history"][step], ref[0]["history"][step], tol)
    got = {n: p for rank in ranks for n, p in rank["params"].items()}
    want = {n: p for rank in ref for n, p in rank["params"].items()}
    assert want.keys() <= got.keys()  # ZBV's stage 0 also holds the tied head's weight
    assert_all_close({n: got[n] for n in want}, want, max(tol, 1e-6))
