"""Host-side helpers shared by the kernel launchers: lazy kernel loading and launch sizes.

Triton decides at kernel-definition time whether a kernel is compiled (GPU) or interpreted
(TRITON_INTERPRET=1, CPU tensors), so the `_triton_*` modules are imported on first use, never
when megatron_lite is imported, and the mode they were loaded in is remembered here.

On the meta device (the rank dry run) the launchers run as on a GPU, allocating every output
and workspace, but the launch itself does nothing: meta tensors have shapes and no data, so
the dry run sees exactly the memory the kernels' autograd Functions hold.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

_LOADED_INTERPRETED: dict[str, bool] = {}


class _NoLaunch:
    """A stand-in for a `@triton.jit` kernel: `kernel[grid](*args)` does nothing."""

    def __getitem__(self, grid: object) -> _NoLaunch:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


class _MetaKernels:
    """What `load_triton_module` returns for meta tensors: every kernel is `_NoLaunch`."""

    def __getattr__(self, name: str) -> _NoLaunch:
        return _NoLaunch()


def load_triton_module(name: str, device: torch.device) -> ModuleType | _MetaKernels:
    """Imports megatron_lite.kernels._triton_<name>, checking it can run on `device`."""
    if device.type == "meta":
        return _MetaKernels()
    interpret_now = os.environ.get("TRITON_INTERPRET") == "1"
    interpreted = _LOADED_INTERPRETED.setdefault(name, interpret_now)
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "Triton kernels on CPU tensors run only under Triton's interpreter, chosen when the "
            "kernels first load: export TRITON_INTERPRET=1 before the first kernel call (resolve_"
            "use_triton does it for --triton-kernels on), or use --triton-kernels off/auto"
        )
    if device.type != "cpu" and interpreted:
        raise RuntimeError("Triton kernels were loaded under TRITON_INTERPRET=1 (CPU only); unset "
                           "it to run them on " + str(device))
    return importlib.import_module(f"megatron_lite.kernels._triton_{name}")


def compiled_kernels_loaded() -> bool:
    """True once any kernel module was loaded for the GPU (it cannot then run on CPU tensors)."""
    return not all(_LOADED_INTERPRETED.values())


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_block_and_warps(n_cols: int, max_block: int = 65536) -> tuple[int, int]:
    """Block covering a whole row (so a row is one load) and warps scaled to it.

    Wider rows get more warps so each thread keeps a handful of elements in registers; the
    thresholds follow the Triton layer-norm tutorial's sizing.
    """
    block = next_power_of_2(n_cols)
    if block > max_block:
        raise ValueError(f"row of {n_cols} elements exceeds the kernel's {max_block} limit")
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
    return block, num_warps


def rows_per_program(block_cols: int, n_rows: int, budget: int = 4096) -> int:
    """Rows per program tile so a tile holds about `budget` elements: 1 row at Llama widths,
    many for short rows (where a row per program would leave programs nearly idle)."""
    return max(1, min(next_power_of_2(n_rows), budget // block_cols))


def num_persistent_programs(device: torch.device) -> int:
    """Programs for kernels that loop over rows and keep partial sums (one per SM, twice over)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4
