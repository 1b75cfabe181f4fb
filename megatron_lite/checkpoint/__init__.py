"""Checkpoints: parallel atomic save, exact resume, resharding across layouts.

`files` is the on-disk format, `reshard` reads any layout into any other, `checkpointer`
is what the training loop calls. Export to / import from Hugging Face is
`megatron_lite.export`.
"""

from megatron_lite.checkpoint.checkpointer import Checkpointer
from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.checkpoint.reshard import CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader", "Checkpointer"]
