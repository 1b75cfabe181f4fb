"""The `staged-gloo` backend: every collective and send/recv copies its tensors to host memory,
runs there over gloo, and copies the results back to the tensors' device.

Why: one lent GPU must still prove the two-rank layouts (TP, PP, CP's ring, ZeRO-3). NCCL
refuses two ranks on one GPU, and gloo's CUDA support has no send/recv and no
reduce-scatter, so pipeline and ring-attention runs could not start. Staging through the
host gives each op gloo's CPU implementation, which has them all, while the model computes
on the GPU. It is a correctness backend (every op waits on a device->host copy), never a
fast one. Host tensors are refused on a CUDA run, as NCCL refuses them, so a tensor left on
the CPU by mistake still fails here; on a CPU run (the smoke test) the same code stages
through fresh host buffers.

The class overrides the Python-level methods torch.distributed's functions call on a group
(`group.allreduce(...)`, `group.send(...)`), so the ops run through this code whatever the
caller; each returns a `_Staged` work that finishes gloo's work and then copies back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

NAME = "staged-gloo"


class _Staged(dist.Work):
    """gloo's work on the host copies; `wait` finishes it, then writes the results back."""

    def __init__(self, inner: dist.Work, copy_back: Callable[[], object]) -> None:
        super().__init__()
        self.inner, self.copy_back, self.done = inner, copy_back, False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self.done:
            self.inner.wait()
            self.copy_back()
            self.done = True
        return True

    def is_completed(self) -> bool:
        """Polled by comms.barrier's timeout: once gloo is done, copy back and say so."""
        if not self.done and self.inner.is_completed():
            self.wait()
        return self.done

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


class StagedGloo(dist.ProcessGroup):
    """One group of the run: a gloo group over the same ranks does the moving, on host copies.

    `device_type` is where the run's tensors live ("cuda" on a GPU, "cpu" in the smoke test);
    a tensor anywhere else is refused by name.
    """

    def bind(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
             device_type: str) -> None:
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore(NAME, store), rank, size, timeout)
        self.device_type = device_type

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    @property
    def group_name(self) -> str:
        """The name torch gave this group (read back when one group is destroyed); torch
        sets it only on its own groups, so ours keeps it here."""
        return self.name_

    def _host(self, tensors: Sequence[Tensor], fill: bool = True) -> list[Tensor]:
        """Host copies (or empty host buffers) of `tensors`, after checking their device."""
        for t in tensors:
            if t.device.type != self.device_type:
                raise RuntimeError(
                    f"{NAME}: a {t.device.type} tensor {tuple(t.shape)} reached a collective "
                    f"of a {self.device_type} run (NCCL would refuse it too)")
        return [t.to("cpu", copy=True) if fill else torch.empty_like(t, device="cpu")
                for t in tensors]

    @staticmethod
    def _back(targets: Sequence[Tensor], hosts: Sequence[Tensor]) -> Callable[[], None]:
        def copy() -> None:
            for target, host in zip(targets, hosts):
                target.copy_(host)
        return copy

    def allreduce(self, tensors: list[Tensor], opts: object) -> dist.Work:
        hosts = self._host(tensors)
        return _Staged(self.gloo.allreduce(hosts, opts), self._back(tensors, hosts))

    def broadcast(self, tensors: list[Tensor], opts: object) -> dist.Work:
        hosts = self._host(tensors)
        return _Staged(self.gloo.broadcast(hosts, opts), self._back(tensors, hosts))

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor],
                  opts: object) -> dist.Work:
        host_out = [self._host(out, fill=False) for out in outputs]
        work = self.gloo.allgather(host_out, self._host(inputs), opts)
        return _Staged(work, self._back([t for o in outputs for t in o],
                                        [t for o in host_out for t in o]))

    def all_gather_single(self, output: Tensor, input: Tensor, opts: object) -> dist.Work:
        (host_out,), (host_in,) = self._host([output], fill=False), self._host([input])
        work = self.gloo._allgather_base(host_out, host_in, opts)
        return _Staged(work, self._back([output], [host_out]))

    def reduce_scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]],
                       opts: object) -> dist.Work:
        host_out = self._host(outputs, fill=False)
        work = self.gloo.reduce_scatter(host_out, [self._host(i) for i in inputs], opts)
        return _Staged(work, self._back(outputs, host_out))

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: object) -> dist.Work:
        (host_out,), (host_in,) = self._host([output], fill=False), self._host([input])
        work = self.gloo._reduce_scatter_base(host_out, host_in, opts)
        return _Staged(work, self._back([output], [host_out]))

    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: object) -> dist.Work:
        (host_out,), (host_in,) = self._host([output], fill=False), self._host([input])
        work = self.gloo.alltoall_base(host_out, host_in, output_split_sizes,
                                       input_split_sizes, opts)
        return _Staged(work, self._back([output], [host_out]))

    def barrier(self, opts: object) -> dist.Work:
        return self.gloo.barrier(opts)

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> dist.Work:
        hosts = self._host(tensors)  # kept alive by the work until gloo has sent them
        return _Staged(self.gloo.send(hosts, dst, tag), lambda: hosts)

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> dist.Work:
        hosts = self._host(tensors, fill=False)
        return _Staged(self.gloo.recv(hosts, src, tag), self._back(tensors, hosts))


def register(device_type: str) -> None:
    """Make `staged-gloo` a backend name init_process_group accepts, for `device_type`
    tensors (idempotent: a second call in one process changes nothing)."""
    if NAME in dist.Backend.backend_list:
        return

    def create(opts: object, _backend_options: object) -> StagedGloo:
        """torch's extended creator: the one that passes the group's name."""
        group = StagedGloo(opts.group_rank, opts.group_size)
        group.name_ = opts.group_id
        group.bind(opts.store, opts.group_rank, opts.group_size, opts.timeout, device_type)
        return group

    dist.Backend.register_backend(NAME, create, extended_api=True, devices=[device_type])
