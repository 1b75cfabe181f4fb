"""The measured-floor bound of the kernel tests can fail, and is sharper than the constants it
replaced: a kernel off by 1e-6 relative in fp32 (which the old 1e-5 bound let through), or by
two bf16 ulps, or one that leaves an element unwritten, is caught."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.kernels.rmsnorm import rms_norm
from megatron_lite.kernels.swiglu import swiglu
from tests.kernels.util import check_kernel, leaf


def _rmsnorm_case(dtype, gen):
    x = leaf((5, 48), dtype, "cpu", gen)
    w = (1.0 + 0.1 * torch.randn(48, generator=gen)).to(dtype).requires_grad_()
    return [x, w], [torch.randn(5, 48, generator=gen).to(dtype)]


def _reference(a, b):
    return rms_norm(a, b, 1e-5)


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1 + 1e-6),
                                              (torch.bfloat16, 1 + 2**-6)])
def test_a_slightly_scaled_kernel_fails(dtype, scale, gen):
    inputs, grads = _rmsnorm_case(dtype, gen)
    assert check_kernel(_reference, _reference, inputs, grads, ("y", "dx", "dw")) <= 1.0
    with pytest.raises(AssertionError, match="measured floor"):
        check_kernel(lambda a, b: _reference(a, b) * scale, _reference, inputs, grads,
                     ("y", "dx", "dw"))


def test_an_unwritten_element_fails(gen):
    gate, up = leaf((3, 20), torch.float32, "cpu", gen), leaf((3, 20), torch.float32, "cpu", gen)
    dy = torch.randn(3, 20, generator=gen)

    def leaky(a, b):
        y = swiglu(a, b).clone()
        y.view(-1)[7] = float("nan")  # what the poisoned buffers show for a skipped store
        return y

    with pytest.raises(AssertionError, match="NaN"):
        check_kernel(leaky, swiglu, [gate, up], [dy], ("y", "d_gate", "d_up"))
