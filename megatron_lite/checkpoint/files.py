"""The on-disk checkpoint format: names, atomic writes, tensor files, metadata, validation.

    <save>/latest                              "iter_0000010\\n", replaced atomically
    <save>/iter_0000010/metadata.json          rank 0, written last: config, layout, files
    <save>/iter_0000010/model_tp0_pp0.safetensors        dp rank 0 of each (tp, pp) position
    <save>/iter_0000010/optim_tp0_pp0_dp0.safetensors    every dp rank with ZeRO-1, else dp 0
    <save>/iter_0000010/rank_00000.safetensors           every rank: RNG and loader state
  with expert parallelism (EP > 1) the routed experts have their own files, per EP rank:
    <save>/iter_0000010/experts_tp0_pp0_ep1.safetensors  expert-DP rank 0 of each EP rank
    <save>/iter_0000010/optim_experts_tp0_pp0_ep1_dp0.safetensors   idem, per expert-DP rank

Every tensor file is safetensors (tensors + a JSON string in the header), metadata is JSON:
nothing is unpickled on load, so a checkpoint from elsewhere cannot run code. A directory is
written as `iter_XXXXXXX.tmp/`, each file fsynced, `metadata.json` last (it lists every file
with its byte size and sha256), then renamed and `latest` replaced: a crash at any point leaves
the previous checkpoint and the pointer to it intact. On load the sizes and checksums are
verified before any tensor is read, so a flipped bit on disk is found, not trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor

from megatron_lite.errors import UserError

FORMAT = "megatron_lite.checkpoint"
FORMAT_VERSION = 1
"""Bump when a reader of the old version could misread the new files."""
LATEST = "latest"
METADATA = "metadata.json"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_SECRET_NAME = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY)$", re.I)
REDACTED = "<redacted>"

# Config fields that change the weights' shapes or meaning: a checkpoint only loads into a
# run with the same values (parallel layout, batch sizes, schedule may all change).
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "vocab_size", "untie_embeddings_and_output_weights",
                "norm_epsilon", "rotary_base", "kv_channels", "add_qkv_bias", "qk_layernorm",
                "use_rope_scaling", "rope_scaling_factor", "rotary_percent")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and the fix."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def model_file(tp: int, pp: int) -> str:
    return f"model_tp{tp}_pp{pp}.safetensors"


def optim_file(tp: int, pp: int, dp: int) -> str:
    return f"optim_tp{tp}_pp{pp}_dp{dp}.safetensors"


def expert_model_file(tp: int, pp: int, ep: int) -> str:
    return f"experts_tp{tp}_pp{pp}_ep{ep}.safetensors"


def expert_optim_file(tp: int, pp: int, ep: int, edp: int) -> str:
    return f"optim_experts_tp{tp}_pp{pp}_ep{ep}_dp{edp}.safetensors"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# ---- durable writes ------------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


Pieces = Callable[[Sequence[Tensor]], Iterator[Any]]
"""Tensors -> their bytes back to back, as buffers (each valid until the next is taken)."""


def tensor_bytes(t: Tensor) -> Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def host_pieces(tensors: Sequence[Tensor]) -> Iterator[Any]:
    """The bytes of host tensors, one tensor at a time, without a copy."""
    for t in tensors:
        if t.numel():
            yield tensor_bytes(t).numpy()


def safetensors_header(tensors: dict[str, Tensor], metadata: dict[str, str]
                       ) -> tuple[bytes, list[str]]:
    """The header `safetensors.torch.save` would write for `tensors` (length prefix, JSON,
    space padding) and the order of their data after it, without their bytes in memory.

    The order is safetensors' own (by dtype, then name): read from the header of a save of
    one-element stand-ins with the same names and dtypes; the offsets follow from the sizes.
    """
    stand_in = save({k: torch.zeros(1, dtype=v.dtype) for k, v in tensors.items()},
                    metadata=metadata)
    length = struct.unpack("<Q", stand_in[:8])[0]
    parsed = json.loads(stand_in[8:8 + length])
    order = [k for k in parsed if k != "__metadata__"]
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": parsed[name]["dtype"], "shape": list(t.shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_tensors(path: Path, tensors: dict[str, Tensor], meta: dict,
                  pieces: Pieces | None = None) -> tuple[int, str]:
    """One safetensors file with `meta` as JSON in its header; fsynced.

    The bytes are exactly `safetensors.torch.save`'s, but streamed: the header, then the
    tensors' data as `pieces` hands it out (default: host tensors in place; a save from the
    device passes `HostStaging.pieces`, a bounded staging buffer), so no file-sized buffer
    is ever built. Returns (bytes, sha256); the checksum is of the bytes handed to the OS,
    so saving never reads the file back.
    """
    metadata = {"format": "pt", "megatron_lite": json.dumps(meta)}
    header, order = safetensors_header(tensors, metadata)
    digest, size = hashlib.sha256(header), len(header)
    with open(path, "wb") as f:
        f.write(header)
        for piece in (pieces or host_pieces)([tensors[k] for k in order]):
            f.write(piece)
            digest.update(piece)
            size += len(piece)
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def file_sha256(path: Path, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class TensorFile:
    """Lazy reader of one tensor file: the header is parsed, tensors are read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is "
                                  "incomplete: load another with --ckpt-step")
        try:
            self._handle = safe_open(str(path), framework="pt")
            header = self._handle.metadata() or {}
            self.meta = json.loads(header.get("megatron_lite", "{}"))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {path} is not a valid safetensors file "
                                  f"({e}); it is truncated or corrupt, or not a megatron_lite "
                                  "checkpoint (pickled .pt files are never loaded)") from e
        self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        return key in self._handle.keys()  # noqa: SIM118 (safe_open is not a dict)

    def get(self, key: str) -> Tensor:
        try:
            tensor = self._handle.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint file {self.path}: cannot read {key!r} ({e})") from e
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


# ---- state dicts <-> (tensors, JSON) --------------------------------------------------------

def flatten_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, Tensor]]:
    """Split a nested dict/list state into JSON (tensors replaced by references) and tensors."""
    tensors: dict[str, Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, Tensor):
            tensors[path] = obj
            return {"__tensor__": path}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise TypeError(f"state at {path or '<root>'} has non-string keys")
            return {k: walk(v, f"{path}.{k}" if path else k) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        return obj

    return walk(state, prefix), tensors


def unflatten_state(skeleton: Any, tensors: TensorFile) -> Any:
    """Inverse of `flatten_state`, reading each referenced tensor from `tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors.get(skeleton["__tensor__"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


# ---- secrets --------------------------------------------------------------------------------

def secret_values(environ: dict[str, str] | None = None) -> set[str]:
    """Values of environment variables whose names look like credentials (>= 6 chars)."""
    env = os.environ if environ is None else environ
    return {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 6}


def redact(obj: Any, secrets: Iterable[str]) -> Any:
    """A copy of a JSON-like object with every string containing a secret replaced."""
    secrets = [s for s in secrets if s]
    if isinstance(obj, dict):
        return {k: redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str) and any(s in obj for s in secrets):
        return REDACTED
    return obj


# ---- finding and validating a checkpoint ----------------------------------------------------

def list_iterations(root: Path) -> list[int]:
    """Complete (renamed) iteration directories under `root`, ascending."""
    if not root.is_dir():
        return []
    found = [int(m.group(1)) for p in root.iterdir() if (m := _ITER_RE.match(p.name))]
    return sorted(found)


def resolve_checkpoint_dir(root: Path, step: int | None) -> Path | None:
    """The directory to load: `root` itself if it is one, `--ckpt-step`, or `latest`.

    None when `root` holds no checkpoint at all (a fresh run); an error when it holds
    iteration directories but no readable `latest`, or the asked step is absent.
    """
    if (root / METADATA).is_file():
        return root
    iterations = list_iterations(root)
    if step is not None:
        path = root / iter_dir_name(step)
        if not path.is_dir():
            raise CheckpointError(f"--ckpt-step {step}: {path} does not exist; iterations "
                                  f"found in {root}: {iterations or 'none'}")
        return path
    pointer = root / LATEST
    if not pointer.is_file():
        if not iterations:
            return None
        raise CheckpointError(
            f"{pointer} is missing, but {root} holds iterations {iterations}: the last save "
            f"did not finish. Pick one with --ckpt-step (e.g. --ckpt-step {iterations[-1]})")
    name = pointer.read_text().strip()
    if not _ITER_RE.match(name) or not (root / name).is_dir():
        raise CheckpointError(f"{pointer} holds {name[:60]!r}, which is not a checkpoint "
                              f"directory in {root}; iterations found: {iterations or 'none'}. "
                              "Fix the file or pass --ckpt-step")
    return root / name


def checkpoint_candidates(root: Path, step: int | None) -> list[Path]:
    """Directories to try, best first: the one `resolve_checkpoint_dir` picks, then (only
    when it came from `latest`) every older complete iteration, newest first.

    Iterations newer than `latest` are never candidates: they are stale leftovers of an
    earlier run that a resume from an older step has since superseded.
    """
    chosen = resolve_checkpoint_dir(root, step)
    if chosen is None or chosen == root or step is not None:
        return [] if chosen is None else [chosen]
    newest = int(_ITER_RE.match(chosen.name).group(1))  # type: ignore[union-attr]
    return [chosen, *(root / iter_dir_name(i) for i in reversed(list_iterations(root))
                      if i < newest)]


def verify_checksums(ckpt_dir: Path, meta: dict, names: Iterable[str]) -> None:
    """Compare each named file's sha256 with the one recorded at save time.

    Files saved before checksums existed have none recorded: their size was checked by
    `read_metadata`, which is all that can be checked.
    """
    recorded = meta.get("sha256", {})
    for name in names:
        if name in recorded and file_sha256(ckpt_dir / name) != recorded[name]:
            raise CheckpointError(f"checkpoint file {ckpt_dir / name} is corrupt: its sha256 "
                                  "differs from the one recorded in metadata.json when it was "
                                  "saved (bad disk, bad copy, or edited)")


def read_metadata(ckpt_dir: Path) -> dict:
    """metadata.json, checked for format and version, with every listed file present."""
    path = ckpt_dir / METADATA
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete checkpoint"
                              ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a megatron_lite checkpoint (format "
                              f"{meta.get('format')!r})")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}, newer than the {FORMAT_VERSION} "
            "this megatron_lite reads: upgrade megatron_lite (or export it to Hugging Face "
            "format with the newer version)")
    for name, size in meta["files"].items():
        file = ckpt_dir / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (listed in {path})")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} has {file.stat().st_size} bytes, "
                                  f"expected {size}: it is truncated or was overwritten")
    return meta


def model_mismatches(saved_model: dict, running_model: dict) -> list[str]:
    """'--flag: checkpoint X, this run Y' for each model-shape field that differs (a field a
    checkpoint predates is not compared: it was saved before the option existed)."""
    return [f"--{k.replace('_', '-')}: checkpoint {saved_model.get(k)!r}, this run "
            f"{running_model.get(k)!r}" for k in MODEL_FIELDS
            if k in saved_model and saved_model[k] != running_model.get(k)]


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def commit(save_dir: Path, tmp: Path, iteration: int, meta: dict, keep_last: int | None
           ) -> Path:
    """Finish a checkpoint whose files are all in `tmp`: metadata last, rename, `latest`.

    Runs on one process (rank 0) after every rank's files are fsynced. Older iterations
    beyond `keep_last` are deleted only after `latest` points at the new one.
    """
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration, **meta}
    path = tmp / METADATA
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    final = save_dir / iter_dir_name(iteration)
    if final.exists():  # re-saving an iteration (e.g. after a resume): replace it whole
        old = final.with_name(final.name + ".old")
        remove_tree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        remove_tree(old)
    else:
        os.replace(tmp, final)
    fsync_path(save_dir)
    write_text_atomic(save_dir / LATEST, final.name + "\n")
    if keep_last:
        for old_iteration in list_iterations(save_dir)[:-keep_last]:
            if old_iteration != iteration:
                remove_tree(save_dir / iter_dir_name(old_iteration))
    return final


def clear_stale(save_dir: Path) -> None:
    """Remove leftovers of interrupted saves: `*.tmp` directories, and `*.old` ones whose
    replacement is in place (an `.old` without one is renamed back: it is the checkpoint)."""
    if not save_dir.is_dir():
        return
    for p in save_dir.iterdir():
        if not (p.is_dir() and p.name.startswith("iter_")):
            continue
        if p.suffix == ".tmp":
            remove_tree(p)
        elif p.suffix == ".old":
            if p.with_suffix("").exists():
                remove_tree(p)
            else:
                os.replace(p, p.with_suffix(""))
