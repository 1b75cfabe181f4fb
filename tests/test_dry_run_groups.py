"""The dry run knows which group each collective belongs to: every call site names a group
kind and the audit checks the group it passes is this rank's group of that kind.

Each plant below is a one-line source change of a real call site (recompiled in place, so the
audit names the original file and line): a wrong group that every member picks alike, which
matches perfectly and would corrupt silently (or mismatch all-to-all sizes on NCCL).
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from types import ModuleType

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.layers import fp8, moe
from megatron_lite.parallel import audit, state
from megatron_lite.parallel.audit import WrongGroupError, match
from tests.test_dry_run import TINY
from tests.test_moe_dry_run import TINY_MOE

EXPERTS_EP2_DP4 = (4, [*TINY_MOE, "--moe-token-dispatcher-type", "alltoall"])
"""EP 2 over DP 4: expert-DP groups [0, 2] and [1, 3], dense DP [0, 1, 2, 3]."""
ALLTOALL_TP2_EP2 = (4, [*TINY_MOE, "--moe-token-dispatcher-type", "alltoall",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel"])
"""TP 2 x EP 2: EP groups [0, 2] and [1, 3], TP groups [0, 1] and [2, 3]."""
FP8_TP2_DP2 = (4, [*TINY, "--tensor-model-parallel-size", "2", "--global-batch-size", "2",
                   "--fp8-format", "hybrid", "--bf16"])
"""TP 2 x DP 2, tensorwise current-scaling FP8: every amax is MAX-reduced over TP."""


def _plant(monkeypatch: pytest.MonkeyPatch, module: ModuleType, owner: object, name: str,
           old: str, new: str) -> None:
    """Replace `owner.name` (a function, method or property of `module`) by its own source
    with `old` changed to `new`, compiled under the original file name and line numbers."""
    attr = inspect.getattr_static(owner, name)
    func = attr.fget if isinstance(attr, property) else attr
    lines, first = inspect.getsourcelines(func)
    source = textwrap.dedent("".join(lines))
    assert source.count(old) == 1, f"the plant's target {old!r} is not in {name}"
    code = compile("\n" * (first - 1) + source.replace(old, new), inspect.getfile(func), "exec")
    space: dict = {}
    exec(code, vars(module), space)  # a test's plant of one known source line
    monkeypatch.setattr(owner, name, space[name])  # the source keeps its decorators


@functools.cache
def _unplanted(layout: tuple[int, tuple[str, ...]]) -> str | None:
    world, flags = layout
    cfg = parse_config([*flags, "--dry-run"])
    return match({r: run_rank(cfg, world, r, time_host=False).ops for r in range(world)})


@pytest.mark.parametrize("layout", [EXPERTS_EP2_DP4, ALLTOALL_TP2_EP2, FP8_TP2_DP2],
                         ids=["experts-ep2-dp4", "alltoall-tp2-ep2", "fp8-tp2-dp2"])
def test_the_layouts_match_unplanted(layout) -> None:
    assert _unplanted((layout[0], tuple(layout[1]))) is None


def _fails(layout: tuple[int, list[str]]) -> str:
    world, flags = layout
    with pytest.raises(WrongGroupError) as err:
        run_rank(parse_config([*flags, "--dry-run"]), world, 0, time_host=False)
    return str(err.value)


def test_expert_gradients_over_dense_dp_are_refused(monkeypatch) -> None:
    _plant(monkeypatch, state, state.ParallelState, "expert_replicas",
           "ReplicaGroup(self.edp_group, self.edp_size, self.edp_rank,",
           "ReplicaGroup(self.dp_group, self.dp_size, self.dp_rank,")
    text = _fails(EXPERTS_EP2_DP4)
    assert "megatron_lite/optim/" in text
    assert "this rank's edp group, ranks [0, 2], but was passed ranks [0, 1, 2, 3]" in text


def test_moe_counts_over_tp_are_refused(monkeypatch) -> None:
    _plant(monkeypatch, moe, moe.MoE, "_all_to_all", "all_to_all_counts(counts, group,",
           "all_to_all_counts(counts, self.etp_group,")
    text = _fails(ALLTOALL_TP2_EP2)
    assert "all_to_all at megatron_lite/layers/moe.py:" in text and "(_all_to_all)" in text
    assert "this rank's ep group, ranks [0, 2], but was passed ranks [0, 1]" in text


def test_fp8_amax_over_the_world_is_refused(monkeypatch) -> None:
    _plant(monkeypatch, fp8, fp8, "_reduced", "comms.all_reduce_(amax, group,",
           "comms.all_reduce_(amax, dist.group.WORLD,")
    text = _fails(FP8_TP2_DP2)
    assert "all_reduce at megatron_lite/layers/fp8.py:" in text and "(_reduced)" in text
    assert "this rank's tp group, ranks [0, 1], but was passed ranks [0, 1, 2, 3]" in text


def test_an_op_without_a_kind_or_of_a_kind_the_rank_lacks_is_refused() -> None:
    groups = {"tp": (0, 1), "world": (0, 1, 2, 3)}
    with pytest.raises(WrongGroupError, match="names no group kind"):
        audit._check_group(groups, None, "all_reduce", (0, 1), None, "x.py:1 (f)")
    with pytest.raises(WrongGroupError, match="kind 'ep', which this rank does not have"):
        audit._check_group(groups, "ep", "all_reduce", (0, 1), None, "x.py:1 (f)")
    with pytest.raises(WrongGroupError, match=r"tp group, ranks \[0, 1\], but was passed "
                                              r"ranks \[0, 1, 2, 3\] \(peer 2\)"):
        audit._check_group(groups, "tp", "send", (0, 1, 2, 3), 2, "x.py:1 (f)")
    audit._check_group(groups, "tp", "send", (0, 1, 2, 3), 1, "x.py:1 (f)")  # peer in TP
