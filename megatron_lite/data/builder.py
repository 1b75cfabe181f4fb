"""Builds the train and validation loaders for this DP rank from the data config.

Real data: `--data-path` (prefixes or manifests, optionally a weighted blend) and `--split`, or
one blend per split (`--train-data-path`, `--valid-data-path`, `--test-data-path`),
`--tokenizer-model` (vocab size and EOD; must agree with the manifests), `--data-sharding`,
`--data-cache-path`, `--eod-mask-loss`. Every shard this rank reads is validated before the
first step; a bad one stops the run with its file name and the command that regenerates it.
On several ranks one rank does the validation and index building for the others
(`Coordinator`), and its verdicts and indices are cached for the next start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from megatron_lite.config import Config, ConfigError, ModelConfig, global_batch_at, parse_blend
from megatron_lite.data.dataset import Prep, build_datasets
from megatron_lite.data.format import ShardError, find_manifest, load_manifest
from megatron_lite.data.loader import MicroBatchLoader, SequenceLayout
from megatron_lite.data.mock import MockDataset

if TYPE_CHECKING:
    from tokenizer.spec import TokenizerSpec

_DEFAULT_VOCAB = ModelConfig.vocab_size


@dataclass
class TokenizerInfo:
    vocab_size: int | None
    eod_id: int | None
    source: str
    warnings: list[str] = field(default_factory=list)
    """Disagreements that do not stop training (for rank 0 to print)."""


def resolve_tokenizer(cfg: Config) -> TokenizerInfo:
    """Vocab size and EOD id from --tokenizer-model and/or the manifests; sets
    cfg.model.vocab_size (call before building the model). A disagreement between the
    tokenizer and the manifests is an error (shards made with another tokenizer)."""
    info = tokenizer_info(cfg)
    cfg.model.vocab_size = info.vocab_size or cfg.model.vocab_size
    return info


def tokenizer_spec(cfg: Config) -> TokenizerSpec | None:
    """The run's tokenizer flags (None: none given, the manifests say)."""
    from tokenizer.spec import TokenizerSpec

    vocab: int | None = cfg.model.vocab_size
    if cfg.data.tokenizer_type == "TikTokenizer" and vocab == _DEFAULT_VOCAB:
        vocab = None  # --vocab-size not given: Megatron's TikTokenizer default
    return TokenizerSpec.from_data_config(dataclasses.asdict(cfg.data), vocab)


def tokenizer_info(cfg: Config) -> TokenizerInfo:
    """What resolve_tokenizer finds, without changing cfg."""
    d = cfg.data
    if d.mock_data or not d.all_paths():
        return TokenizerInfo(cfg.model.vocab_size, None, "--vocab-size")
    found: list[tuple[str, int, int | None, str | None]] = []
    spec = tokenizer_spec(cfg)
    if spec is not None:
        from tokenizer.spec import load_tokenizer

        tok = load_tokenizer(spec)
        found.append((spec.flags(), tok.vocab_size, tok.eod_id, tok.sha256()))
    for _, path in [pair for paths in d.all_paths() for pair in parse_blend(paths)]:
        manifest_path = find_manifest(path)
        if manifest_path is not None:
            t = load_manifest(manifest_path).tokenizer
            if t.get("vocab_size") is not None:
                made = f" (made with {t['flags']})" if t.get("flags") else ""
                found.append((f"manifest {manifest_path}{made}", int(t["vocab_size"]),
                              t.get("eod_id"), t.get("sha256")))
    if not found:
        raise ConfigError("--data-path without a manifest needs the tokenizer flags "
                          "(--tokenizer-type, --tokenizer-model; NullTokenizer: --vocab-size, "
                          "--null-tokenizer-eod-id) to know the vocabulary size and EOD id")
    ref = found[0]
    for other in found[1:]:
        if (other[1], other[2]) != (ref[1], ref[2]):
            raise ConfigError(
                f"tokenizer mismatch: {ref[0]} has vocab {ref[1]}, EOD {ref[2]} but {other[0]} "
                f"has vocab {other[1]}, EOD {other[2]}; the shards were made with another "
                "tokenizer: pass the tokenizer flags data_tools.preprocess was given (the "
                "manifest records them) or re-preprocess")
    warnings = [
        f"{other[0]} was made with a tokenizer file of sha256 {other[3][:12]}, not {ref[0]}'s "
        f"{ref[3][:12]}; vocab size and EOD agree, so training goes on, but the same id may "
        "stand for another piece: pass the tokenizer that data_tools.preprocess used"
        for other in found[1:] if other[3] and ref[3] and other[3] != ref[3]]
    return TokenizerInfo(ref[1], ref[2], ref[0], warnings)


@dataclass
class Coordinator:
    """A multi-rank job's plan for the data at start-up, made by training (which knows the
    process groups; data imports nothing from parallel).

    Rank `preparer` validates the shards and builds the index caches that this rank reads
    (global rank 0 for shared storage; one rank per node and DP shard set for node-local
    data); every rank then meets at `wait`, and the others open the shards with the cached
    verdicts and memory-map the indices. So a thousand ranks do not each scan every token
    and write the same cache at once.
    """

    rank: int
    preparer: int
    wait: Callable[[str | None], str | None]
    """Barrier over all ranks: this rank's error (None when fine) -> a failed rank's error as
    `rank R: message`, or None; it raises, naming whom it waited for, on its timeout."""
    world_size: int = 1
    prep: Prep = field(default_factory=Prep)
    """This rank's part, as the dataset code sees it (and its phase times)."""

    def __post_init__(self) -> None:
        self.prep.rank = self.rank
        self.prep.required = self.rank == self.preparer and self.world_size > 1


def _prepared(build: Callable[[Prep], list], coordinator: Coordinator | None) -> list:
    """`build` on the preparing rank, then (after the barrier) on the others."""
    if coordinator is None:
        return build(Prep())
    datasets = None
    if coordinator.rank == coordinator.preparer:
        try:
            datasets = build(coordinator.prep)
        except Exception as e:
            coordinator.wait(str(e) or type(e).__name__)  # the others learn it and stop too
            raise
    failed = coordinator.wait(None)
    if failed:
        raise ConfigError(f"data: stopping, as {failed}")
    return datasets if datasets is not None else build(coordinator.prep)


def _real_datasets(cfg: Config, dp_rank: int, dp_size: int, gbs: int,
                   coordinator: Coordinator | None = None, *, train_only: bool = False) -> list:
    d, t = cfg.data, cfg.train
    node_local = (dp_rank, dp_size) if d.data_sharding == "node-local" else None
    evaluating = t.eval_iters > 0 and not train_only
    needed = [t.train_iters * gbs, validation_samples(cfg, gbs) if evaluating else 0,
              t.eval_iters * gbs if evaluating else 0]
    if node_local:
        needed = [n // dp_size for n in needed]

    def build_all(prep: Prep) -> list:
        build = partial(build_datasets, seq_length=cfg.model.seq_length, seed=t.seed,
                        cache_dir=d.data_cache_path, node_local=node_local,
                        vocab_size=cfg.model.vocab_size, prep=prep)
        try:
            if d.data_path:
                datasets = build(d.data_path, d.split, num_samples=needed)
            else:  # one whole corpus per split: split "1,0,0" for train, "0,1,0" for valid, ...
                datasets = [build(paths, ",".join("1" if j == which else "0" for j in range(3)),
                                  num_samples=[n if j == which else 0 for j in range(3)])[which]
                            if paths else None
                            for which, (paths, n) in enumerate(zip(
                                (d.train_data_path, d.valid_data_path, d.test_data_path),
                                needed))]
            preparer = coordinator is None or coordinator.rank == coordinator.preparer
            if d.verify_checksums and not train_only and preparer:
                with prep.timed("data validation"):  # the preparer hashes for its readers
                    _verify(cfg, node_local)
        except (ShardError, ValueError) as e:
            raise ConfigError(str(e)) from e
        return datasets

    datasets = _prepared(build_all, coordinator)
    if datasets[0] is None:
        given = (f"--data-path {' '.join(d.data_path)} with --split {d.split}" if d.data_path
                 else f"--train-data-path {' '.join(d.train_data_path)}")
        raise ConfigError(f"{given} leaves no training sample of --seq-length "
                          f"{cfg.model.seq_length}")
    return datasets


def validation_samples(cfg: Config, global_batch_size: int) -> int:
    """Megatron's validation set size: --eval-iters global batches for each of the
    (--train-iters // --eval-interval + 1) evaluations, each reading the next ones
    (training.eval_start); the test set is one evaluation's."""
    t = cfg.train
    evaluations = 1 if t.eval_interval is None else t.train_iters // t.eval_interval + 1
    return evaluations * t.eval_iters * global_batch_size


def _verify(cfg: Config, node_local: tuple[int, int] | None) -> None:
    from megatron_lite.data.format import shards_for_dp_rank

    for _, path in [pair for paths in cfg.data.all_paths() for pair in parse_blend(paths)]:
        manifest_path = find_manifest(path)
        if manifest_path is None:
            continue
        m = load_manifest(manifest_path)
        m.verify_checksums(shards_for_dp_rank(len(m.shards), *node_local) if node_local
                           else None)


def separate_documents(cfg: Config) -> bool:
    """Whether attention stops at end-of-document tokens: Megatron's --reset-attention-mask
    acts through the dataloader's attention mask, so not with
    --no-create-attention-mask-in-dataloader."""
    return cfg.data.reset_attention_mask and cfg.data.create_attention_mask_in_dataloader


def data_notes(cfg: Config) -> list[str]:
    """Start-up lines for data/loss flag combinations that do what Megatron does but a user
    may not expect (rank 0 prints them; the dry run too)."""
    d, notes = cfg.data, []
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        notes.append("--reset-attention-mask has no effect with --no-create-attention-mask-in-"
                     "dataloader (as in Megatron, where it edits the dataloader's mask): "
                     "attention is plainly causal across the documents of a sample")
    if d.reset_position_ids and not separate_documents(cfg):
        notes.append("--reset-position-ids without --reset-attention-mask: positions restart "
                     "after each end-of-document token, but tokens still attend to the "
                     "earlier documents of their sample")
    if d.eod_mask_loss and not cfg.train.calculate_per_token_loss:
        notes.append("--eod-mask-loss without --calculate-per-token-loss: each micro-batch's "
                     "loss is averaged over its own valid tokens (Megatron's default), so a "
                     "token of a micro-batch with more end-of-document tokens weighs more; "
                     "add --calculate-per-token-loss for the mean over every token")
    return notes


@dataclass
class Loaders:
    train: MicroBatchLoader
    valid: MicroBatchLoader | None
    test: MicroBatchLoader | None
    """Evaluated once after training (the held-out test split or --test-data-path)."""


def build_data_loaders(cfg: Config, dp_rank: int, dp_size: int,
                       consumed_train_samples: int = 0, cp_rank: int = 0
                       ) -> tuple[MicroBatchLoader, MicroBatchLoader | None]:
    """(train loader, validation loader or None)."""
    loaders = build_loaders(cfg, dp_rank, dp_size, consumed_train_samples, cp_rank=cp_rank)
    return loaders.train, loaders.valid


def build_loaders(cfg: Config, dp_rank: int, dp_size: int, consumed_train_samples: int = 0,
                  coordinator: Coordinator | None = None, cp_rank: int = 0) -> Loaders:
    """The train, validation and test loaders of this DP rank (mock data has no test set);
    `coordinator`: who prepares the data files of a multi-rank job (see `Coordinator`); under
    CP, `cp_rank`'s chunks of the DP rank's samples."""
    train_cfg, model_cfg, d = cfg.train, cfg.model, cfg.data
    gbs = train_cfg.global_batch_size or train_cfg.micro_batch_size * dp_size
    layout = SequenceLayout(cp_rank, cfg.parallel.context_parallel_size,
                            d.reset_position_ids, separate_documents(cfg))
    common = dict(micro_batch_size=train_cfg.micro_batch_size, global_batch_size=gbs,
                  dp_rank=dp_rank, dp_size=dp_size, layout=layout)
    ramp = (partial(global_batch_at, train_cfg, seq_length=model_cfg.seq_length)
            if train_cfg.rampup_batch_size or train_cfg.step_batch_size_schedule else None)
    documents = layout.reset_position_ids or layout.reset_attention_mask
    if cfg.data.mock_data and documents:
        raise ConfigError("--reset-position-ids / --reset-attention-mask split samples at "
                          "end-of-document tokens, which --mock-data has none of; use "
                          "--data-path with --tokenizer-model (or --tokenizer-type NullTokenizer)")
    if cfg.data.mock_data:
        train = MockDataset(model_cfg.vocab_size, model_cfg.seq_length, train_cfg.seed, "train")
        valid = MockDataset(model_cfg.vocab_size, model_cfg.seq_length, train_cfg.seed, "valid")
        return Loaders(MicroBatchLoader(train, consumed_samples=consumed_train_samples,
                                        prefetch=cfg.data.num_workers, batch_size_at=ramp,
                                        **common),
                       MicroBatchLoader(valid, **common), None)
    if not cfg.data.all_paths():
        raise ConfigError("no data: pass --mock-data, or --data-path (or --train-data-path) "
                          "with --tokenizer-model")
    tok = tokenizer_info(cfg)
    if tok.vocab_size != model_cfg.vocab_size:
        raise ConfigError(f"the model has --vocab-size {model_cfg.vocab_size} but {tok.source} has "
                          f"{tok.vocab_size} tokens; pass --vocab-size {tok.vocab_size}")
    if (documents or d.eod_mask_loss) and tok.eod_id is None:
        raise ConfigError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask need "
                          f"an end-of-document id, and {tok.source} gives none; pass a tokenizer "
                          "with one (an eos_token in tokenizer_config.json for "
                          "HuggingFaceTokenizer), or --tokenizer-type NullTokenizer "
                          "--null-tokenizer-eod-id N")
    train, valid, test = _real_datasets(cfg, dp_rank, dp_size, gbs, coordinator)
    common.update(eod_id=tok.eod_id, eod_mask_loss=cfg.data.eod_mask_loss,
                  node_local=cfg.data.data_sharding == "node-local")
    # a node-local resume at another DP size reads the old ranks' streams (loader docstring)
    streams = partial(_old_rank_stream, cfg, gbs)
    return Loaders(MicroBatchLoader(train, consumed_samples=consumed_train_samples,
                                    prefetch=cfg.data.num_workers, batch_size_at=ramp,
                                    stream_factory=streams, **common),
                   MicroBatchLoader(valid, **common) if valid is not None else None,
                   MicroBatchLoader(test, **common) if test is not None else None)


def _old_rank_stream(cfg: Config, gbs: int, dp_rank: int, dp_size: int) -> object:
    """The node-local training dataset DP rank `dp_rank` of a DP-`dp_size` run reads (the same
    shards, sample count, seed and therefore index as that run built)."""
    return _real_datasets(cfg, dp_rank, dp_size, gbs, train_only=True)[0]


def samples_per_epoch_of(dataset: object) -> int:
    """Samples of one pass over a dataset: a GPT dataset's epoch, the sum over a blend's parts
    (one pass over every source), else its length (mock data)."""
    index = getattr(dataset, "index", None)
    if index is not None:
        return int(index.samples_per_epoch)
    parts = getattr(dataset, "datasets", None)
    if parts is not None:
        return sum(samples_per_epoch_of(p) for p in parts)
    return len(dataset)  # type: ignore[arg-type]


def planned_samples(cfg: Config, global_batch_size: int) -> int:
    """Training samples the run will draw: --train-samples, or --train-iters global batches
    (summed over a ramp-up or --step-batch-size-schedule, whose last step may overshoot
    --train-samples)."""
    t = cfg.train
    if not t.rampup_batch_size and t.step_batch_size_schedule is None:
        return t.train_samples if t.train_samples is not None else (
            t.train_iters * global_batch_size)
    consumed = 0
    for _ in range(t.train_iters):
        consumed += global_batch_at(t, consumed, cfg.model.seq_length)
    return consumed
