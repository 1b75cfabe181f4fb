"""Knowledge distillation with Megatron's ModelOpt flags: --export-kd-teacher-load DIR and
--export-kd-cfg YAML.

A frozen teacher (its shape from DIR's checkpoint metadata, built with the student's TP/CP
layout and dtype, weights from our checkpoint format) runs each micro-batch under no_grad
beside the student's last chunk. Per token, as ModelOpt's Megatron plugin defines the terms:

- logits: KL(teacher || student) of the softmaxes at temperature T (logits / T, no T^2
  factor), computed over the TP-sharded vocabulary (`vocab_parallel_kl`: all-reduced max and
  sum, never a gathered vocabulary);
- each `intermediate_layer_pairs` entry: 1 - cos(student, teacher) of the two hidden states
  ("cosine", the default) or their mean squared difference ("mse"); the pairs are averaged.
  Here the only hidden state named is `decoder.final_layernorm` (the final norm's output).

Per micro-batch (masked sums over its tokens, as ModelOpt's balancer weighs them): the
intermediate term is rescaled to the logits term's size (a detached factor L / I), and
    skip_lm_loss true:  loss = L + I'
    skip_lm_loss false: loss = LM + kd_loss_scale * (L + I') * (LM / (L + I'))  (detached ratio)
so kd_loss_scale only matters with the LM loss on, as in ModelOpt. The value the run logs
and checks as "loss" stays the student's LM loss (what Megatron reports as "lm loss", here
measured even with skip_lm_loss); the gradient is the distillation loss's. The totals are
logged beside it as "total loss", "logits distillation loss", "intermediate distillation loss".

Not here (refused at start-up): pipeline or virtual pipeline stages (Megatron sends the
teacher's activations along with the student's), ZeRO-3, a teacher of another width with
intermediate pairs (ModelOpt adds a trained projection), other module names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.checkpoint.reshard import CheckpointReader, local_slice, model_parameters
from megatron_lite.config import Config, ConfigError, ModelConfig
from megatron_lite.kernels._precision import upcast
from megatron_lite.metrics import DISTILL_TERMS
from megatron_lite.model.llama import BatchContext, LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState

LOGIT_LAYER = "output_layer"
HIDDEN_LAYERS = ("decoder.final_layernorm",)
"""ModelOpt module names this model exposes: the output layer (logits) and the final norm."""
PAIR_LOSSES = ("cosine", "mse")
KEYS = ("intermediate_layer_pairs", "logit_layers", "skip_lm_loss", "kd_loss_scale",
        "logit_kl_temperature")


@dataclass(frozen=True)
class DistillConfig:
    """--export-kd-cfg, with ModelOpt's defaults (logits only, skip_lm_loss true)."""

    intermediate_losses: tuple[str, ...] = ()
    """One loss ("cosine" or "mse") per intermediate pair, all on the final norm's output."""
    skip_lm_loss: bool = True
    kd_loss_scale: float = 1.0
    logit_kl_temperature: float = 1.0


def load_distill_config(path: str | None) -> DistillConfig:
    """Read and check --export-kd-cfg (None: the defaults)."""
    if path is None:
        return DistillConfig()
    flag = f"--export-kd-cfg {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read it ({e.strerror}); give the distillation "
                          "YAML file") from None
    try:
        import yaml  # installed with transformers, huggingface_hub and wandb
    except ImportError:
        raise ConfigError(f"{flag}: reading it needs PyYAML (pip install pyyaml)") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag}: not valid YAML ({str(e).splitlines()[0]})") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag}: expected a mapping of {', '.join(KEYS)}")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise ConfigError(f"{flag}: unsupported key(s) {', '.join(unknown)}; this run reads "
                          f"{', '.join(KEYS)}")
    logits = doc.get("logit_layers", [LOGIT_LAYER, LOGIT_LAYER])
    if list(logits) != [LOGIT_LAYER, LOGIT_LAYER]:
        raise ConfigError(f"{flag}: logit_layers {logits}: the logits are the output layer's "
                          f"here, give [{LOGIT_LAYER}, {LOGIT_LAYER}]")
    losses = tuple(_pair_loss_name(flag, pair) for pair in doc.get("intermediate_layer_pairs")
                   or [])
    scale, temperature = doc.get("kd_loss_scale", 1.0), doc.get("logit_kl_temperature", 1.0)
    for key, value in (("kd_loss_scale", scale), ("logit_kl_temperature", temperature)):
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{flag}: {key} must be a positive number, got {value!r}")
    skip = doc.get("skip_lm_loss", True)
    if not isinstance(skip, bool):
        raise ConfigError(f"{flag}: skip_lm_loss must be true or false, got {skip!r}")
    return DistillConfig(losses, skip, float(scale), float(temperature))


def _pair_loss_name(flag: str, pair: object) -> str:
    ok = isinstance(pair, list | tuple) and len(pair) in (2, 3)
    names = list(pair)[:2] if ok else []
    loss = list(pair)[2] if ok and len(pair) == 3 else "cosine"
    if not ok or any(n not in HIDDEN_LAYERS for n in names) or loss not in PAIR_LOSSES:
        raise ConfigError(f"{flag}: intermediate_layer_pairs entry {pair!r}: give [student, "
                          f"teacher] or [student, teacher, loss] with names from "
                          f"{', '.join(HIDDEN_LAYERS)} and a loss from {', '.join(PAIR_LOSSES)}")
    return loss


# ---------------------------------------------------------------------------------------------
# The teacher: where it is, its shape, its weights


def teacher_dir(cfg: Config) -> Path | None:
    """The checkpoint --export-kd-teacher-load points at (its `latest`), None if none there."""
    root = Path(cfg.train.export_kd_teacher_load or "")
    return ckpt_files.resolve_checkpoint_dir(root, None) if root.is_dir() else None


def teacher_model_config(cfg: Config, ckpt_dir: Path | None) -> ModelConfig:
    """The teacher's shape: its checkpoint's, with this run's kernels choice; the student's
    own shape when `ckpt_dir` is None (a dry run without the checkpoint at hand)."""
    if ckpt_dir is None:
        return cfg.model
    saved = dict(ckpt_files.read_metadata(ckpt_dir)["config"]["model"])
    saved["triton_kernels"] = cfg.model.triton_kernels
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


def distill_errors(cfg: Config, teacher: ModelConfig, dcfg: DistillConfig) -> list[str]:
    """What a distillation run with this student, layout and teacher cannot do."""
    flag, student, par = "--export-kd-teacher-load", cfg.model, cfg.parallel
    errors = []
    if dcfg.intermediate_losses and teacher.hidden_size != student.hidden_size:
        errors.append(f"{flag}: intermediate_layer_pairs compare hidden states, but the "
                      f"teacher is {teacher.hidden_size} wide and the student "
                      f"{student.hidden_size} (ModelOpt's learned projection is not "
                      "implemented); drop the pairs from --export-kd-cfg")
    if par.pipeline_model_parallel_size > 1:
        errors.append(f"{flag} with --pipeline-model-parallel-size "
                      f"{par.pipeline_model_parallel_size}: distillation runs on one pipeline "
                      "stage here (the teacher's activations are not sent between stages)")
    if par.data_parallel_sharding_strategy == "optim_grads_params":
        errors.append(f"{flag}: not with ZeRO-3 (--data-parallel-sharding-strategy "
                      "optim_grads_params); use ZeRO-1 (--use-distributed-optimizer)")
    if teacher.vocab_size != student.vocab_size:
        errors.append(f"{flag}: the teacher's vocabulary has {teacher.vocab_size} tokens, the "
                      f"student's {student.vocab_size}; distillation needs the same tokenizer")
    tp = par.tensor_model_parallel_size
    if teacher.padded_vocab_size(tp) != student.padded_vocab_size(tp):
        errors.append(f"{flag}: the teacher pads its vocabulary to "
                      f"{teacher.padded_vocab_size(tp)} rows, the student to "
                      f"{student.padded_vocab_size(tp)}; give the student the teacher's "
                      "--make-vocab-size-divisible-by / --padded-vocab-size")
    if teacher.max_position_embeddings < student.seq_length:
        errors.append(f"{flag}: the teacher's RoPE covers {teacher.max_position_embeddings} "
                      f"positions, fewer than --seq-length {student.seq_length}")
    for name in ("num_attention_heads", "num_query_groups"):
        if getattr(teacher, name) % tp:
            errors.append(f"{flag}: the teacher's {name} {getattr(teacher, name)} does not "
                          f"split over --tensor-model-parallel-size {tp}")
    return errors


def check_distillation(cfg: Config, *, dry_run: bool = False) -> tuple[ModelConfig, Path | None]:
    """(teacher shape, its checkpoint) after every check, or ConfigError. A dry run without
    the checkpoint plans a teacher of the student's shape (`dry_run_note` says so)."""
    dcfg = load_distill_config(cfg.train.export_kd_cfg)
    try:
        ckpt_dir = teacher_dir(cfg)
    except OSError as e:
        raise ConfigError(f"--export-kd-teacher-load {cfg.train.export_kd_teacher_load}: "
                          f"cannot read it ({e.strerror})") from None
    if ckpt_dir is None and not dry_run:
        raise ConfigError(f"--export-kd-teacher-load {cfg.train.export_kd_teacher_load}: no "
                          "checkpoint there (no `latest`, no iter_* directory); point it at a "
                          "megatron_lite checkpoint (a Hugging Face teacher converts with "
                          "python -m megatron_lite.export --from-hf)")
    try:
        teacher = teacher_model_config(cfg, ckpt_dir)
    except (ckpt_files.CheckpointError, KeyError, TypeError) as e:
        raise ConfigError(f"--export-kd-teacher-load {ckpt_dir}: unreadable checkpoint "
                          f"metadata ({e})") from None
    errors = distill_errors(cfg, teacher, dcfg)
    if errors:
        raise ConfigError("; ".join(errors))
    return teacher, ckpt_dir


def dry_run_note(cfg: Config, ckpt_dir: Path | None) -> str:
    """The dry-run summary's line on the teacher."""
    where = cfg.train.export_kd_teacher_load
    if ckpt_dir is None:
        return (f"dry run: distillation teacher: no checkpoint in {where} on this machine; "
                "planned with the student's shape (its weights counted in mem_gib); a run "
                "needs the checkpoint there")
    return f"dry run: distillation teacher from {ckpt_dir} (its weights counted in mem_gib)"


@torch.no_grad()
def load_teacher_weights(teacher: LlamaChunk, ckpt_dir: Path, pstate: ParallelState) -> None:
    """This rank's slices of the teacher's weights, from any saved TP/PP layout."""
    meta = ckpt_files.read_metadata(ckpt_dir)
    ckpt_files.verify_checksums(ckpt_dir, meta, [n for n in meta["files"]
                                                 if n.startswith("model_")])
    reader = CheckpointReader(ckpt_dir)
    for name, _local, param in model_parameters([teacher], reader.tied):
        param.copy_(local_slice(reader.full_weight(name), param, pstate))


# ---------------------------------------------------------------------------------------------
# The losses


def vocab_parallel_kl(student: Tensor, teacher: Tensor, vocab_start: int, vocab_size: int,
                      group: comms.Group, temperature: float = 1.0) -> Tensor:
    """Per-token KL(p_teacher || p_student) [s, b] from this rank's logits [s, b, V/t] each.

    Padding columns (ids >= `vocab_size`) take no part. With z the student's shifted logits
    and Z their exp-sum over the whole vocabulary, KL = sum_v p_t (log p_t - z_v) + log Z
    (sum_v p_t = 1): both sums are all-reduced with an identity backward, which gives every
    rank d/dz_v = q_v - p_t,v for its own columns (q the student's softmax).
    """
    n_valid = max(0, min(student.shape[-1], vocab_size - vocab_start))
    s = upcast(student[..., :n_valid]) / temperature
    with torch.no_grad():
        t = upcast(teacher[..., :n_valid]) / temperature
        t_max, s_max = _global_max(t, group), _global_max(s.detach(), group)
        t = t - t_max[..., None]
        t_sum = comms.all_reduce_(t.exp().sum(-1), group, kind="tp")
        log_p = t - t_sum.log()[..., None]
        p = log_p.exp()
    z = s - s_max[..., None]
    cross = comms.reduce_from_region((p * (log_p - z)).sum(-1), group, kind="tp")
    return cross + comms.reduce_from_region(z.exp().sum(-1), group, kind="tp").log()


def _global_max(x: Tensor, group: comms.Group) -> Tensor:
    local = x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))
    return comms.all_reduce_(local, group, torch.distributed.ReduceOp.MAX, kind="tp")


def pair_loss(student: Tensor, teacher: Tensor, kind: str) -> Tensor:
    """Per-token loss [s, b] of two hidden states [s, b, h]: 1 - cosine, or the mean squared
    difference."""
    a, b = upcast(student), upcast(teacher).detach()
    if kind == "cosine":
        return 1 - F.cosine_similarity(a, b, dim=-1)
    return (a - b).square().mean(-1)


def combine(terms: Tensor, mask: Tensor, divisor: Tensor, dcfg: DistillConfig
            ) -> dict[str, Tensor]:
    """ModelOpt's balance of one micro-batch's per-token terms [3, b, s] (LM, logits KL,
    mean intermediate loss): the masked sums over `divisor` and the loss to backpropagate."""
    lm, logits, inter = ((row * mask).sum() / divisor for row in terms)
    # the intermediate term at the logits term's size; unscaled where it is not positive
    scaled = inter * torch.where(inter > 0, logits / inter.clamp_min(1e-30), 1.0).detach()
    kd = logits + scaled
    if dcfg.skip_lm_loss:
        total = kd
    else:
        ratio = torch.where((kd > 0) & (lm > 0), lm / kd.clamp_min(1e-30), 1.0).detach()
        total = lm + dcfg.kd_loss_scale * kd * ratio
    return {"lm loss": lm, "total loss": total, "logits distillation loss": logits,
            "intermediate distillation loss": inter}


class DistillationChunk(nn.Module):
    """The student's (only) chunk with the frozen teacher beside it: returns per-token terms
    [3, b, s] (LM loss, logits KL, intermediate loss) for `Distiller.loss`."""

    def __init__(self, student: LlamaChunk, teacher: LlamaChunk, dcfg: DistillConfig) -> None:
        super().__init__()
        self.student, self.dcfg = student, dcfg
        self.teacher = [teacher]  # a list: not a submodule, so no .parameters() sees it
        self.pre_process, self.post_process = student.pre_process, student.post_process
        self.weight_grads, self.layer_ids = student.weight_grads, student.layer_ids

    def forward(self, x: Tensor, labels: Tensor | None = None,
                batch: BatchContext | None = None) -> Tensor:
        if labels is None:
            raise ValueError("the distillation chunk needs labels")
        teacher, out = self.teacher[0], self.student.output
        with torch.no_grad():
            t_hidden = teacher.final_hidden(x, batch)
            t_logits = teacher.output.logits(t_hidden)
        hidden = self.student.final_hidden(x, batch)
        logits = out.logits(hidden)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.dcfg.skip_lm_loss):
            lm = out.token_losses(logits, labels)
        kl = vocab_parallel_kl(logits, t_logits, out.vocab_start, out.vocab_size,
                               out.tp_group, self.dcfg.logit_kl_temperature).t()
        inter = torch.zeros_like(kl)
        for kind in self.dcfg.intermediate_losses:
            per_token = pair_loss(hidden, t_hidden, kind)  # [s(/t), b]: SP splits the tokens
            if out.sequence_parallel:
                per_token = comms.gather_from_region(per_token, 0, out.tp_group, kind="tp")
            inter = inter + per_token.t() / len(self.dcfg.intermediate_losses)
        return torch.stack([lm.to(kl.dtype), kl, inter])


class Distiller:
    """The teacher-carrying chunks the step runs, their loss function, and what it logs."""

    def __init__(self, chunks: list[DistillationChunk], dcfg: DistillConfig) -> None:
        self.chunks, self.dcfg = chunks, dcfg
        self.terms: list[dict[str, Tensor]] = []
        """Each micro-batch's detached terms since the last `pop_terms`."""

    def loss(self, terms: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
        """engine's LossFn: the value is the LM share (logged, checked), the gradient the
        distillation loss's."""
        parts = combine(terms, batch["loss_mask"], batch["loss_divisor"], self.dcfg)
        self.terms.append({k: v.detach() for k, v in parts.items() if k in DISTILL_TERMS})
        total = parts["total loss"]
        return parts["lm loss"].detach() + (total - total.detach())

    def pop_terms(self) -> list[dict[str, Tensor]]:
        terms, self.terms = self.terms, []
        return terms


def build_distiller(cfg: Config, pstate: ParallelState, chunks: list[LlamaChunk]
                    ) -> Distiller | None:
    """The distiller of a --export-kd-teacher-load run (None without it): the teacher built
    like the student's chunk (its dtype, kernels, sequence parallelism; no recomputation: it
    keeps nothing for backward). On the meta device (dry run) it loads no weights."""
    if cfg.train.export_kd_teacher_load is None:
        return None
    dry = pstate.device.type == "meta"
    teacher_cfg, ckpt_dir = check_distillation(cfg, dry_run=dry)
    # the student's context without recomputation or split backward
    ctx = dataclasses.replace(chunks[0].ctx, recompute_granularity=None, split_backward=False)
    teacher = LlamaChunk(teacher_cfg, ctx, list(range(teacher_cfg.num_layers)),
                         pre_process=True, post_process=True)
    teacher.requires_grad_(False).eval()
    if ckpt_dir is not None and not dry:
        load_teacher_weights(teacher, ckpt_dir, pstate)
    dcfg = load_distill_config(cfg.train.export_kd_cfg)
    if pstate.rank == 0:
        source = ckpt_dir or "none here, the student's shape (dry run)"
        print(f"distillation: teacher {source}: {teacher_cfg.num_layers} layers, hidden "
              f"{teacher_cfg.hidden_size}; {dcfg}", flush=True)
    return Distiller([DistillationChunk(chunks[0], teacher, dcfg)], dcfg)
