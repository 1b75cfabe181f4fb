"""megatron_lite: a small Megatron-style pretraining codebase. Importing it has no side effects."""

__version__ = "0.1.0"
