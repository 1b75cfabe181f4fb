"""--deterministic-mode: the same run twice gives bit-identical losses, on GPU as on CPU.

What makes a GPU run vary between reruns, and what is set against it (before the first cuBLAS
handle and the first NCCL communicator exist, which read these once):
- kernels with atomic accumulation: `torch.use_deterministic_algorithms(True)` makes the
  flash and memory-efficient attention backwards take their deterministic variants, keeps
  SDPA off cuDNN attention, and stops the run naming any op that has no deterministic kernel.
  Our Triton kernels use no atomics and fixed launch grids (deterministic already);
- cuBLAS's split-K workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8);
- NCCL choosing its algorithm per call from topology and size: NCCL_ALGO=Ring (fixed order;
  CollnetDirect, CollnetChain and ^NVLS are also accepted, Tree is not).
A value the user exported is kept when it is one of those, and refused otherwise.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from megatron_lite.config import ConfigError

ENV_DEFAULTS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
NCCL_DETERMINISTIC = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def env_errors(env: MutableMapping[str, str]) -> list[str]:
    """Exported values that would make a --deterministic-mode run vary."""
    errors = []
    cublas = env.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is not None and cublas not in CUBLAS_DETERMINISTIC:
        errors.append(f"--deterministic-mode needs CUBLAS_WORKSPACE_CONFIG in "
                      f"{' or '.join(CUBLAS_DETERMINISTIC)}, got {cublas!r}; unset it")
    algo = env.get("NCCL_ALGO")
    tokens = [t.strip() for t in (algo or "").split(",") if t.strip()]
    if algo is not None and (not tokens or any(t not in NCCL_DETERMINISTIC for t in tokens)):
        errors.append("--deterministic-mode needs NCCL_ALGO made of "
                      f"{', '.join(NCCL_DETERMINISTIC)} (a fixed reduction order), got "
                      f"{algo!r}; unset it for Ring")
    return errors


def enable(env: MutableMapping[str, str] = os.environ) -> None:
    """Check and fill the environment, then turn on torch's deterministic algorithms.
    Raises ConfigError naming a variable that would break determinism."""
    errors = env_errors(env)
    if errors:
        raise ConfigError("\n  - ".join(["invalid environment:", *errors]))
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
