"""Layout-independent views of a checkpoint, and their re-slicing into a running layout.

Every weight has a global name (`layers.7.mlp.down.weight`, whatever stage or chunk holds
layer 7) and a TP split saying how tensor parallelism cut it (see layers/tags.py). The
"full" tensor of a name is the unsharded weight with the padded vocabulary rows removed
(they are zero and never trained), so a checkpoint written with one (TP, PP, DP, v,
distributed-optimizer) layout reads the same from any other. Optimizer state is stored in
the optimizer's own flat, per-DP-rank format (`megatron_lite.optim.zero1`); it is rebuilt per
parameter here by placing each DP rank's owned ranges back into the flat buffer.

The tied output layer of the last pipeline stage is a copy of `embedding.weight` (same
values, same optimizer state): it is not stored, and filled from the embedding on load.

Routed experts (layers/moe.py: each rank stacks its E/ep experts, `layers.{l}.mlp.gate_up`
and `.down`) are saved by each (EP, expert-TP) position in its own files when they are laid
out apart from the dense weights (EP > 1 or expert TP < TP; files.py, named by the
expert-TP rank), their optimizer state in the expert group's own zero1 format over
expert-DP. Their "full" tensor is the EP-unsplit stack of all E experts (each EP rank's
expert-TP-unsharded stack, in EP-rank order), which is exactly what an EP=1 run holds
unsharded, so any (EP, expert-TP, TP) layout reads any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from megatron_lite.checkpoint.files import (
    CheckpointError,
    TensorFile,
    expert_model_file,
    expert_optim_file,
    model_file,
    optim_file,
    read_metadata,
    unflatten_state,
)
from megatron_lite.layers import tags
from megatron_lite.layers.init import shard_full, unshard
from megatron_lite.parallel.state import ParallelState

KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The optimizer tensors kept per parameter element (master weight, Adam moments: fp32, or
float64 under --fp64; they are rebuilt in the dtype they were saved in)."""


def global_name(layer_ids: Sequence[int], local: str, tied: bool) -> str:
    """A chunk-local parameter name -> its name in the whole model."""
    parts = local.split(".")
    if parts[0] == "layers":
        parts[1] = str(layer_ids[int(parts[1])])
    name = ".".join(parts)
    return "embedding.weight" if tied and name == "output.weight" else name


def is_tied_copy(local: str, tied: bool) -> bool:
    """The last stage's copy of the tied embedding (not stored, see module docstring)."""
    return tied and local == "output.weight"


def model_parameters(chunks: Sequence[nn.Module], tied: bool
                     ) -> list[tuple[str, str, nn.Parameter]]:
    """(global name, chunk-local name, parameter) for every parameter of this rank, once."""
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for local, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((global_name(chunk.layer_ids, local, tied), local, p))
    return out


def local_slice(full: Tensor, param: nn.Parameter, pstate: ParallelState) -> Tensor:
    """This rank's slice of a full (vocab-unpadded) tensor, shaped like `param`: a routed
    expert's full stack is first cut to this EP rank's experts, then over expert TP."""
    tp_size, tp_rank = pstate.tp_size, pstate.tp_rank
    if tags.is_expert(param):
        full = full.chunk(pstate.ep_size)[pstate.ep_rank]
        tp_size, tp_rank = pstate.etp_size, pstate.etp_rank
    split = tags.tp_split(param)
    padded_rows = tags.padded_vocab_size(split)
    if padded_rows is not None:
        padded = torch.zeros(padded_rows, *full.shape[1:], dtype=full.dtype)
        padded[:full.shape[0]] = full
        full = padded
    piece = shard_full(full, split, tp_size, tp_rank)
    if piece.shape != param.shape:
        raise CheckpointError(f"a checkpoint tensor of full shape {tuple(full.shape)} does not "
                              f"fit a parameter of local shape {tuple(param.shape)}")
    return piece


class CheckpointReader:
    """Reads weights and optimizer state of one checkpoint directory, in any layout."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.dir = Path(ckpt_dir)
        self.meta = read_metadata(self.dir)
        layout = self.meta["layout"]
        self.tp, self.pp, self.dp = layout["tp"], layout["pp"], layout["dp"]
        self.model_cfg = self.meta["config"]["model"]
        self.weights_in_optimizer = bool(layout.get("weights_in_optimizer"))
        """Saved under ZeRO-3: no weights in the model files, each is its fp32 master cast
        to the run's parameter dtype (exactly what the training step wrote into it)."""
        train_cfg = self.meta["config"]["train"]
        self.param_dtype = (torch.float64 if train_cfg.get("fp64") else
                            torch.bfloat16 if train_cfg["bf16"] else torch.float32)
        self.tied = not self.model_cfg["untie_embeddings_and_output_weights"]
        self.ep = layout.get("ep", 1)
        self.etp = layout.get("etp", self.tp)
        """The EP and expert-TP sizes saved at; with EP > 1 or expert TP < TP the routed
        experts are in per-(EP, expert-TP)-rank files."""
        self._files: dict[str, TensorFile] = {}
        self._optim: dict[tuple[int, int, int | None], dict[str, dict[str, Tensor]]] = {}
        self.where: dict[str, tuple[int, list | None]] = {}
        """Global name -> (pipeline stage holding it, TP split as saved: JSON lists)."""
        self.experts: set[str] = set()
        """The names saved per (EP, expert-TP) rank (empty when saved with the dense ones)."""
        self.in_optimizer: set[str] = set()
        """Weights saved as their masters only (--fp8-param-gather's FP8 weights, whose
        values the run kept as owned slices), besides every weight under ZeRO-3."""
        for stage in range(self.pp):
            stage_meta = self.file(model_file(0, stage)).meta
            self.in_optimizer.update(stage_meta.get("in_optimizer", []))
            for name, split in stage_meta["tp_split"].items():
                self.where[name] = (stage, split)
            if self.ep > 1 or self.etp != self.tp:
                for name, split in self.file(expert_model_file(0, stage, 0)).meta[
                        "tp_split"].items():
                    self.where[name] = (stage, split)
                    self.experts.add(name)

    @property
    def has_optimizer(self) -> bool:
        return bool(self.meta.get("has_optimizer"))

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values())

    def file(self, name: str) -> TensorFile:
        if name not in self._files:
            self._files[name] = TensorFile(self.dir / name)
        return self._files[name]

    def _stage(self, name: str) -> tuple[int, list | None]:
        if name not in self.where:
            raise CheckpointError(f"{self.dir} has no weight {name!r} (it holds "
                                  f"{len(self.where)} weights, e.g. {sorted(self.where)[:3]})")
        return self.where[name]

    def _ep_ranks(self, name: str) -> list[int | None]:
        """The EP ranks whose files hold a piece of `name` (None: the dense files)."""
        return list(range(self.ep)) if name in self.experts else [None]

    def local_weight(self, name: str, tp_rank: int, ep_rank: int | None = None) -> Tensor:
        """The tensor exactly as saved by TP rank `tp_rank` (for a routed expert saved apart:
        expert-TP rank `tp_rank` of EP rank `ep_rank`): the same-layout fast path."""
        stage, _ = self._stage(name)
        if name not in self.experts:
            ep_rank = None
        elif ep_rank is None:
            raise CheckpointError(f"{self.dir}: {name!r} was saved per EP rank; name one")
        if self.weights_in_optimizer or name in self.in_optimizer:
            return self._optim_position(tp_rank, stage, ep_rank)[name]["master"].to(
                self.param_dtype)
        file = (model_file(tp_rank, stage) if ep_rank is None
                else expert_model_file(tp_rank, stage, ep_rank))
        return self.file(file).get(name)

    def _full(self, name: str, pieces: list[Tensor]) -> Tensor:
        split = self._stage(name)[1]
        full = unshard(pieces, split)
        if tags.padded_vocab_size(split) is not None:
            full = full[:self.model_cfg["vocab_size"]]
        return full

    def _slices(self, name: str) -> int:
        """The (expert-)TP files holding a piece of `name`: 1 for a replicated weight."""
        if self._stage(name)[1] is None:
            return 1
        return self.etp if name in self.experts else self.tp

    def full_weight(self, name: str) -> Tensor:
        """The unsharded weight (vocab padding removed), gathered from every TP file."""
        slices = self._slices(name)
        return torch.cat([self._full(name, [self.local_weight(name, tp_rank, ep)
                                            for tp_rank in range(slices)])
                          for ep in self._ep_ranks(name)])

    def full_optimizer(self, name: str) -> dict[str, Tensor]:
        """Unsharded master weight and Adam moments of one weight, in their saved dtype."""
        if not self.has_optimizer:
            raise CheckpointError(f"{self.dir} holds no optimizer state (saved model-only)")
        stage = self._stage(name)[0]
        slices = self._slices(name)
        per_ep = [[self._optim_position(tp_rank, stage, ep)[name] for tp_rank in range(slices)]
                  for ep in self._ep_ranks(name)]
        return {k: torch.cat([self._full(name, [p[k] for p in pieces]) for pieces in per_ep])
                for k in KINDS}

    def _optim_position(self, tp_rank: int, stage: int, ep_rank: int | None = None
                        ) -> dict[str, dict[str, Tensor]]:
        """Per global name, the (TP-local) optimizer tensors of one (tp, pp) position: its
        dense group's, or with `ep_rank` that (EP rank, expert-TP rank `tp_rank`)'s expert
        group's (sharded over the dp x tp / (ep x etp) expert-DP ranks)."""
        key = (tp_rank, stage, ep_rank)
        if key in self._optim:
            return self._optim[key]

        def file_name(d: int) -> str:
            return (optim_file(tp_rank, stage, d) if ep_rank is None
                    else expert_optim_file(tp_rank, stage, ep_rank, d))

        partition = self.meta["partition"][stage]
        first = self.file(file_name(0)).meta["state"]
        replicas = (self.dp if ep_rank is None
                    else self.dp * self.tp // (self.ep * self.etp))
        dp_files = replicas if first["sharded"] else 1
        out: dict[str, dict[str, Tensor]] = {}
        for b, buf in enumerate(first["buffers"]):
            flat: dict[str, Tensor] = {}
            for d in range(dp_files):
                f = self.file(file_name(d))
                state = f.meta["state"]
                owned = state["buffers"][b]["owned"]
                for k in KINDS:
                    data = f.get(state["tensors"][f"{b}.{k}"]["__tensor__"])
                    if k not in flat:  # the saved dtype (float64 under --fp64), never cast
                        flat[k] = torch.zeros(buf["numel"], dtype=data.dtype)
                    offset = 0
                    for start, end in owned:
                        flat[k][start:end] = data[offset:offset + end - start]
                        offset += end - start
            for opt_name, start, end, shape in buf["params"]:
                chunk, _, local = opt_name.partition(".")
                if is_tied_copy(local, self.tied) and stage != 0:
                    continue
                name = global_name(partition[int(chunk.removeprefix("chunk"))], local,
                                   self.tied)
                out[name] = {k: flat[k][start:end].view(shape) for k in KINDS}
        self._optim[key] = out
        return out


def fill_optimizer_state(template: dict, chunks: Sequence[nn.Module], pstate: ParallelState,
                         tied: bool, source: Callable[[str], dict[str, Tensor]]) -> dict:
    """The running optimizer's state in its layout (`template` from its `state_dict()`) with
    every owned element taken from `source(global name)` (full tensors per kind).

    A new state on the host: `template`'s tensors are the optimizer's live buffers, so they
    are neither written nor copied here (`load_state_dict` copies into them). The expert
    group's state (EP > 1, under "expert") is filled the same way.
    """
    params = {f"chunk{c}.{local}": (global_name(chunk.layer_ids, local, tied), p)
              for c, chunk in enumerate(chunks) for local, p in chunk.named_parameters()}
    tensors = {}
    for b, buf in enumerate(template["buffers"]):
        live = template["tensors"].get(f"{b}.master")
        dtype = live.dtype if live is not None else torch.float32  # float64 under --fp64
        flat = {k: torch.zeros(buf["numel"], dtype=dtype) for k in KINDS}
        for opt_name, start, end, _shape in buf["params"]:
            name, param = params[opt_name]
            full = source(name)
            for k in KINDS:
                flat[k][start:end] = local_slice(full[k].to(dtype), param, pstate).reshape(-1)
        for k in KINDS:
            tensors[f"{b}.{k}"] = torch.cat([flat[k][s:e] for s, e in buf["owned"]])
    out = {**template, "tensors": tensors}
    if "expert" in template:
        out["expert"] = fill_optimizer_state(template["expert"], chunks, pstate, tied, source)
    return out


def _saved_state(reader: CheckpointReader, name: str, template: dict) -> dict | None:
    """The optimizer state in file `name` when its layout is `template`'s, else None."""
    f = reader.file(name)
    skeleton = f.meta["state"]
    if (skeleton.get("format") != template["format"] or skeleton["sharded"] != template["sharded"]
            or skeleton["buffers"] != template["buffers"]):
        return None
    return unflatten_state(skeleton, f)


def direct_optimizer_state(reader: CheckpointReader, template: dict, pstate: ParallelState,
                           partition: list) -> dict | None:
    """This rank's saved optimizer state as-is when the saved layout equals the running one
    (the common resume: read only one's own files), else None."""
    if ((reader.tp, reader.pp, reader.ep, reader.etp)
            != (pstate.tp_size, pstate.pp_size, pstate.ep_size, pstate.etp_size)
            or reader.meta["partition"] != partition
            or (template["sharded"] and reader.dp != pstate.dp_size)):
        return None
    dp = pstate.dp_rank if template["sharded"] else 0
    state = _saved_state(reader, optim_file(pstate.tp_rank, pstate.pp_rank, dp), template)
    if state is None:
        return None
    state["dp_rank"], state["dp_size"] = pstate.dp_rank, pstate.dp_size
    if "expert" in template:
        replicas = pstate.expert_replicas
        edp = replicas.rank if template["sharded"] else 0
        expert = _saved_state(reader, expert_optim_file(pstate.etp_rank, pstate.pp_rank,
                                                        pstate.ep_rank, edp), template["expert"])
        if expert is None:
            return None
        expert["dp_rank"], expert["dp_size"] = replicas.rank, replicas.size
        state["expert"] = expert
    return state
