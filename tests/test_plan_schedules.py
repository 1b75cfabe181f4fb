"""The planner's step time per pipeline schedule, and scripts/plan.py ranking them (70B on
1,024 GPUs, the issue's example)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lite.planner import PRESETS, Cluster, Layout, Recompute, evaluate, pretrain_flags


@pytest.mark.quick
def test_zero_bubble_schedules_shrink_the_bubble_at_equal_layout() -> None:
    model, gbs = PRESETS["70B"][1], PRESETS["70B"][2]
    base = Layout(tp=4, pp=4, dp=64, chunks=1, micro_batch=1, sharding="optim",
                  recompute=Recompute(), sequence_parallel=True)
    plans = {name: evaluate(model, dataclasses.replace(base, **kw), Cluster(gpus=1024), gbs,
                            1e12)
             for name, kw in {"1f1b": {}, "zb-h1": {"schedule": "zb-h1"},
                              "zbv": {"schedule": "zbv", "chunks": 2}}.items()}
    assert plans["zbv"].bubble_s < plans["zb-h1"].bubble_s < plans["1f1b"].bubble_s / 2
    assert plans["zbv"].step_s < plans["zb-h1"].step_s < plans["1f1b"].step_s
    # ZBV holds the head on stage 0 and every stage holds p micro-batches until their W
    assert plans["zbv"].memory.stage == 0
    assert "--pipeline-schedule" in pretrain_flags(model, plans["zbv"], gbs)
    assert "--num-layers-per-virtual-pipeline-stage" not in pretrain_flags(model, plans["zbv"],
                                                                          gbs)


def test_plan_cli_ranks_the_schedules_for_70b_on_1024(capsys) -> None:
    import scripts.plan as plan_cli

    assert plan_cli.main(["--preset", "70B", "--gpus", "1024", "--top", "3",
                          "--sharding", "optim"]) == 0
    out = capsys.readouterr().out
    section = out.split("pipeline schedules on #1's")[1].split("pretrain.py flags")[0]
    header = section.splitlines()[1].replace("step s", "step_s").split()
    rows = [line.split() for line in section.splitlines()[2:] if line.strip()]
    ranked = [row[header.index("schedule")] for row in rows]
    assert sorted(ranked) == ["1f1b", "interleaved", "zb-h1", "zbv"]
    steps = [float(row[header.index("step_s")]) for row in rows]
    assert steps == sorted(steps) and ranked[-1] == "1f1b"
