"""Count device->host synchronizations: every point where the host waits for the device.

A GPU run keeps its GPU busy only while the host runs ahead of it; each `.item()`, `bool()`,
`.cpu()`, `.tolist()` of a device tensor (and each op whose output size depends on device
values, such as `nonzero`) stops the host until the device has caught up. `HostSyncCounter`
is a `TorchDispatchMode` that sees them as the aten ops they become
(`_local_scalar_dense`, `_to_copy`/`copy_` to the CPU, `nonzero`, `equal`, ...) and counts
them by kind. On the meta device (the dry run) there is nothing to copy back, so a counted op
returns a stand-in (zeros, 0, False, an empty `nonzero`) and the step goes on; code that
skips a read-back on meta (`comms.host_scalar`) reports it with `note_meta_syncs`, so the
count is what a GPU would pay. An in-place op into a host tensor from a meta one fails here
as it would on a GPU (torch's meta device lets it through).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ACTIVE: list[HostSyncCounter] = []

MOE_SYNC_KIND = "moe_counts"
"""The kind of a MoE layer's one read of its routed counts per micro-batch (layers/moe.py),
which the dry run reports per MoE layer and micro-batch."""

_SIZE_FROM_VALUES = {aten.nonzero.default, aten.masked_select.default,
                     aten._unique2.default, aten.unique_consecutive.default,
                     aten.unique_dim.default}
"""Ops whose output shape is read from device values (a sync before they can return)."""


def _on_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What kind of device->host sync `func(*args, **kwargs)` is, or None."""
    if func is aten._local_scalar_dense.default and _on_device(args[0]):
        return "item"
    if func is aten._to_copy.default and _on_device(args[0]):
        device = kwargs.get("device")
        return "to_cpu" if device is not None and torch.device(device).type == "cpu" else None
    if func is aten.copy_.default and _on_device(args[1]) and not _on_device(args[0]):
        return "copy_to_cpu"
    if func is aten.equal.default and _on_device(args[0]):
        return "equal"
    if func in _SIZE_FROM_VALUES and _on_device(args[0]):
        return func.__name__.split(".")[0]
    if (func is aten.repeat_interleave.Tensor and _on_device(args[0])
            and kwargs.get("output_size") is None):  # its size is the repeats' sum
        return "repeat_interleave"
    return None


def _refuse_meta_into_host(func: Any, args: tuple, kwargs: dict) -> None:
    """Fail an op that writes into a host tensor from a meta one (`cpu_tensor += meta`): torch
    lets meta through, but the same op fails on a GPU (or, with a 0-dim device operand, is a
    hidden sync), so a dry run must fail it too, in the words of a device mismatch. A
    `copy_` to the host is a read-back, counted as one."""
    if func is aten.copy_.default:
        return
    written = [a for a, spec in zip(args, func._schema.arguments, strict=False)
               if spec.alias_info is not None and spec.alias_info.is_write]
    written += [v for k, v in kwargs.items() if k == "out"]
    if not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in written):
        return
    operands = [*args, *kwargs.values()]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in operands):
        raise RuntimeError(f"{func}: Expected all tensors to be on the same device: writes a "
                           "host tensor from a meta tensor (on a GPU a device mismatch or a "
                           "hidden sync)")


def _stand_in(func: Any, args: tuple, kwargs: dict) -> Any:
    """The result of a counted op on meta, where no value exists to copy back."""
    x = args[0]
    if func is aten._local_scalar_dense.default:
        return False if x.dtype == torch.bool else (0.0 if x.dtype.is_floating_point else 0)
    if func is aten._to_copy.default:
        return torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype)
    if func is aten.copy_.default:
        return x
    if func is aten.equal.default:
        return True
    if func is aten.nonzero.default:
        return torch.empty((0, x.dim()), dtype=torch.int64, device=x.device)
    if func is aten.repeat_interleave.Tensor:
        return torch.empty(0, dtype=x.dtype, device=x.device)
    return func(*args, **kwargs)


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as syncs: step()`, then `syncs.total` and `syncs.by_kind`.

    `stand_in=True` answers a read-back of a meta tensor with a stand-in value so that a step
    with a stray sync still runs to its end and every sync is counted; the rank dry run uses
    False, so such a read fails and its audit names the line (a value that does not exist
    must not steer the step)."""

    def __init__(self, stand_in: bool = True) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.stand_in = stand_in

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __enter__(self) -> HostSyncCounter:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _ACTIVE.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        _refuse_meta_into_host(func, args, kwargs)
        kind = _kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        self.by_kind[kind] += 1
        if self.stand_in and any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return _stand_in(func, args, kwargs)
        return func(*args, **kwargs)


def note_meta_syncs(device: torch.device, count: int, kind: str = "skipped_on_meta") -> None:
    """Code that skips a read-back on meta (no value to read) reports what a GPU would pay."""
    if device.type == "meta":
        for counter in _ACTIVE:
            counter.by_kind[kind] += count
