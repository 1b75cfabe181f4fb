"""Fused kernels for the memory-bound ops of a Llama block, each with a plain-PyTorch reference.

Every op takes `use_triton`; False runs the torch reference (the CPU default), True runs the
Triton kernels. Triton is imported only on first use of a Triton path, so importing megatron_lite
never needs triton or a GPU. `resolve_use_triton` turns `--triton-kernels` into that bool once.
"""

from __future__ import annotations

import os

import torch

from megatron_lite.kernels._launch import compiled_kernels_loaded
from megatron_lite.kernels.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.kernels.rmsnorm import rms_norm, rms_norm_residual
from megatron_lite.kernels.rope import apply_rotary, rope_tables
from megatron_lite.kernels.swiglu import swiglu

KERNEL_NAMES = ("rmsnorm", "rmsnorm_residual", "rope", "swiglu", "vocab_parallel_cross_entropy")
"""What `use_triton=True` switches to Triton; the start-up log prints these."""


def resolve_use_triton(mode: str, device: torch.device) -> bool:
    """Resolves `--triton-kernels {auto,on,off}` for `device`: auto = on exactly with CUDA
    (and on the meta device, where a dry run stands in for a GPU run).

    `on` with a CPU device runs the kernels under Triton's interpreter, which Triton selects when a
    kernel is defined, so this sets TRITON_INTERPRET=1 before any of our kernels is loaded; if one
    was already loaded compiled (for a GPU), the CPU run cannot switch and this raises.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--triton-kernels must be auto, on or off, got {mode!r}")
    device = torch.device(device)
    if mode == "off" or (mode == "auto" and device.type not in ("cuda", "meta")):
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if compiled_kernels_loaded():
            raise RuntimeError("--triton-kernels on with a CPU device needs TRITON_INTERPRET=1 "
                               "before the Triton kernels load; export TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    return True


__all__ = [
    "KERNEL_NAMES",
    "apply_rotary",
    "resolve_use_triton",
    "rms_norm",
    "rms_norm_residual",
    "rope_tables",
    "swiglu",
    "vocab_parallel_cross_entropy",
]
