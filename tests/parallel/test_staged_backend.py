"""staged-gloo (megatron_lite/parallel/staged.py) gives the right values for every op the
two-rank layouts make, through torch.distributed's ordinary functions, and refuses a tensor
that is not on the run's device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite.parallel import staged
from megatron_lite.parallel.state import ParallelState
from tests.distributed import run_ranks


def _every_op(pstate: ParallelState) -> dict[str, bool]:
    staged.register("cpu")
    group = dist.new_group([0, 1], backend=staged.NAME)
    rank, peer = pstate.rank, 1 - pstate.rank
    checks = {}
    for dtype in (torch.bfloat16, torch.float16, torch.int64):  # the bf16 layouts' activations
        y = torch.full((3,), rank + 1, dtype=dtype)
        dist.all_reduce(y, group=group)
        out = torch.empty(6, dtype=dtype)
        dist.all_gather_single(out, y, group=group)
        checks[f"{dtype} all_reduce, all_gather"] = bool((out == 3).all())
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, group=group)
    checks["all_reduce"] = bool((x == 3).all())
    gathered = torch.empty(6)
    work = dist.all_gather_single(gathered, torch.full((3,), float(rank)), group=group,
                                       async_op=True)
    work.wait()
    checks["all_gather_single"] = gathered.tolist() == [0.0] * 3 + [1.0] * 3
    parts = [torch.empty(2), torch.empty(2)]
    dist.all_gather(parts, torch.full((2,), float(rank)), group=group)
    checks["all_gather"] = [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]
    out = torch.empty(2)
    dist.reduce_scatter_single(out, torch.arange(4.0) * (rank + 1), group=group)
    checks["reduce_scatter_single"] = out.tolist() == [3 * (2.0 * rank), 3 * (2.0 * rank + 1)]
    a2a = torch.empty(3)
    splits = [2, 1] if rank else [1, 2]  # rank 0 keeps 1 row and sends 2; rank 1 the reverse
    dist.all_to_all_single(a2a, torch.arange(3.0) + 10 * rank, splits, splits, group=group)
    checks["all_to_all_single"] = a2a.tolist() == ([0.0, 10.0, 11.0] if not rank else
                                                   [1.0, 2.0, 12.0])
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=1, group=group)
    checks["broadcast"] = b.tolist() == [1.0, 1.0]
    recv = torch.empty(3)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer,
                                                group), dist.P2POp(dist.irecv, recv, peer, group)]):
        w.wait()
    checks["send_recv"] = recv.tolist() == [float(peer)] * 3
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return checks


def test_every_op_gives_the_right_values(tmp_path) -> None:
    for rank, checks in enumerate(run_ranks(_every_op, 2, tmp_path)):
        assert all(checks.values()), (rank, checks)


def test_a_tensor_off_the_runs_device_is_refused() -> None:
    group = staged.StagedGloo(0, 1)
    group.device_type = "cuda"
    with pytest.raises(RuntimeError, match=r"cpu tensor \(1,\) reached a collective of a cuda"):
        group._host([torch.ones(1)])
