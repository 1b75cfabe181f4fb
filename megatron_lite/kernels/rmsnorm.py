"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), over the last dim of size h:
    r = 1 / sqrt(mean(x^2) + eps);   y = x * r * w
Backward, with g = dL/dy and xh = x * r:
    dx = r * (g * w - xh * mean(g * w * xh));   dw = sum over rows of g * xh
The Triton path follows the row-per-program layout of the Triton "Layer Normalization" tutorial:
the forward saves only r per row; the weight gradient is written as per-program partial sums and
reduced by a second, small kernel. Math is fp32 whatever the input dtype; outputs take x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain-PyTorch RMSNorm in fp32, cast back to x's dtype; autograd gives the backward."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, use_triton: bool = False) -> Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    if use_triton:
        raise NotImplementedError("Triton RMSNorm lands next; use --triton-kernels off")
    return rms_norm_reference(x, weight, eps)


def rms_norm_residual(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, use_triton: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual); the sum is in x's dtype.

    Fusing saves one full read and write of the activation: the sum is formed in registers and
    normalized in the same pass instead of being written out and read back.
    """
    if use_triton:
        raise NotImplementedError("Triton RMSNorm lands next; use --triton-kernels off")
    total = x + residual
    return rms_norm_reference(total, weight, eps), total
