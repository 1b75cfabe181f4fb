"""Device discipline and a record of every collective and p2p op, for the rank dry run.

Every torch.distributed call reaches the dispatcher as a `c10d` op carrying its tensors and its
process group, so one `TorchDispatchMode` sees all of them, whoever issued them (our comms
helpers, the pipeline's batched p2p, torch internals). `CommAudit` refuses a tensor that is not
on the run's device, naming the op, the group and the first megatron_lite frame that issued
it: the check an NCCL group makes at run time, made on the CPU. It also records each op, and
`match` checks that the ranks' records fit together: every send has its receive in the same
order on the peer, and every member of a group issues the same collectives in the same order
with the same shapes and dtypes (NCCL's rules; breaking them deadlocks or corrupts).

NCCL ignores tags: the n-th send from A to B meets the n-th receive on B from A, whatever
either side meant by it, and a `batch_isend_irecv` posts its ops in list order. Equal shapes
are therefore no proof: an activation received into a gradient buffer of the same shape is
silent corruption. So every op also carries an identity, what the program means by it (the
pipeline's tensor kind, micro-batch and sending chunk; a bucket index; a ring step), set by
its call site with `op_identity` / `batch_identity`, and `match` compares identities too.
Outside an audit both return a shared no-op context without building anything.

Equal ops on every member are no proof of the right group either: expert gradients summed
over dense DP, or MoE counts exchanged over TP, match perfectly when every rank makes the same
mistake. So every op also names the logical group it means (`group_kind`: tp, cp, dp, ep, ...;
the comms helpers take it as `kind=`), and an audit given this rank's groups by kind
(`ParallelState.ranks_by_kind`) refuses an op whose group is not this rank's group of that kind
(a p2p op: whose peer is not in it), or that names no kind, naming the call site and both
groups.

`match` is pure Python over the records, so it is tested without processes.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar, Token
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

P2P_OPS = ("send", "recv")

_OP_NAMES = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
             "_allgather_base_": "all_gather", "allgather_": "all_gather",
             "allgather_into_tensor_coalesced_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
             "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv",
             "recv_any_source_": "recv", "barrier": "barrier", "reduce_": "reduce",
             "gather_": "gather", "scatter_": "scatter"}


class DeviceDisciplineError(RuntimeError):
    """A tensor on the wrong device was handed to a collective or p2p op."""


Identity = tuple[str, tuple[tuple[str, int], ...]]
"""What an op means to the program: (kind, ((field, value), ...)), e.g.
("activation", (("mb", 3), ("chunk", 1))). Equal on both ends of a correct transfer and on
every member of a correct collective."""


def identity(kind: str, **fields: int) -> Identity:
    """An identity; the fields keep their keyword order (it is part of the comparison)."""
    return kind, tuple(fields.items())


def describe_identity(ident: Identity | None) -> str:
    """"(grad, mb 2, chunk 0)"; "(no identity)" for an op no call site labelled."""
    if ident is None:
        return "(no identity)"
    kind, fields = ident
    return "(" + ", ".join([kind, *(f"{k} {v}" for k, v in fields)]) + ")"


_recording = 0
"""How many `CommAudit`s are active: identities are built only while one is."""
_current: ContextVar[_Labels | None] = ContextVar("megatron_lite_op_identity", default=None)
_NOTHING = nullcontext()
_kind: ContextVar[str | None] = ContextVar("megatron_lite_group_kind", default=None)


class _Labels(AbstractContextManager):
    """The identities of the ops issued inside one `with`: one for all of them (`by_tensor`
    None), or per op, found by the op's tensor (a batch: whoever reorders its list, each
    transfer keeps the identity of the buffer it moves)."""

    __slots__ = ("by_tensor", "one", "token")

    def __init__(self, one: Identity | None, by_tensor: dict[int, Identity] | None) -> None:
        self.one, self.by_tensor = one, by_tensor
        self.token: Token | None = None

    def __enter__(self) -> None:
        self.token = _current.set(self)

    def __exit__(self, *_: object) -> None:
        _current.reset(self.token)

    def take(self, tensors: list[torch.Tensor]) -> Identity | None:
        if self.by_tensor is None:
            return self.one
        return next((self.by_tensor[id(t)] for t in tensors if id(t) in self.by_tensor), None)


def op_identity(kind: str, **fields: int) -> AbstractContextManager[None]:
    """Every collective or p2p op issued inside takes this identity (while an audit runs;
    otherwise a shared no-op)."""
    if not _recording:
        return _NOTHING
    return _Labels(identity(kind, **fields), None)


def batch_identity(make: Callable[[], Iterable[tuple[torch.Tensor, Identity]]]
                   ) -> AbstractContextManager[None]:
    """Inside, an op moving one of the tensors `make()` lists takes that tensor's identity:
    for one `batch_isend_irecv`, (op.tensor, identity) per P2POp. `make` runs only while an
    audit records, so an unaudited run builds nothing."""
    if not _recording:
        return _NOTHING
    return _Labels(None, {id(t): ident for t, ident in make()})


class _Kind(AbstractContextManager):
    """The group kind of the ops issued inside one `with`."""

    __slots__ = ("kind", "token")

    def __init__(self, kind: str) -> None:
        self.kind, self.token = kind, None

    def __enter__(self) -> None:
        self.token = _kind.set(self.kind)

    def __exit__(self, *_: object) -> None:
        _kind.reset(self.token)


def group_kind(kind: str) -> AbstractContextManager[None]:
    """Every collective or p2p op issued inside means this rank's group of `kind` (a
    `ParallelState.ranks_by_kind` key); checked while an audit runs, otherwise a shared
    no-op. The comms helpers wrap their torch.distributed call in it."""
    return _Kind(kind) if _recording else _NOTHING


class WrongGroupError(RuntimeError):
    """A collective or p2p op was handed a group other than the one its call site names."""


def recording() -> bool:
    """A `CommAudit` is active (identities are being collected)."""
    return _recording > 0


@dataclass(frozen=True)
class CommOp:
    """One collective or p2p op as issued by one rank."""

    op: str
    """all_reduce | all_gather | reduce_scatter | broadcast | send | recv | ..."""
    group: tuple[int, ...]
    """Global ranks of the process group."""
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of every tensor the op was given, in argument order."""
    nbytes: int
    """Bytes of the largest tensor of the op: the full buffer of a gather or scatter, the
    tensor itself of a reduction or a p2p transfer."""
    peer: int | None = None
    """Global rank at the other end of a send or recv."""
    site: str = ""
    """file:line (function) of the code that issued it (first frame outside torch and the
    comms helpers)."""
    identity: Identity | None = None
    """What the call site meant by it (`op_identity`); None where no call site said."""
    kind: str | None = None
    """The logical group its call site names (`group_kind`)."""
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """An all_to_all's (rows received from, rows sent to) each group member, in group order:
    uneven under real routing, so its rows are matched pairwise, not by shape."""

    def describe(self) -> str:
        where = f" peer {self.peer}" if self.peer is not None else f" group {list(self.group)}"
        return f"{self.op} {describe_identity(self.identity)}{where} {self.payload()}"

    def payload(self) -> str:
        """What travels, for a p2p message that has already named both ends."""
        return f"{self.dtype} {[list(s) for s in self.shapes]} ({self.site})"


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HELPERS = tuple(os.path.join(_ROOT, "megatron_lite", "parallel", f) for f in ("audit.py",
                                                                               "comms.py"))


def _call_site() -> str:
    """file:line (function) of the innermost frame that is not torch's, the comms helpers'
    or a dispatch mode's: the code that handed the tensor over."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (name.startswith(_TORCH) or name in _HELPERS
                or frame.f_code.co_name == "__torch_dispatch__"):
            short = os.path.relpath(name, _ROOT) if name.startswith(_ROOT) else name
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"


class CommAudit(TorchDispatchMode):
    """While active: refuse off-device tensors in communication, record every op in `ops`;
    given `groups` (this rank's group ranks by kind), refuse an op over a group other than
    the one its call site names."""

    def __init__(self, device: torch.device,
                 groups: Mapping[str, tuple[int, ...]] | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.groups = groups
        self.ops: list[CommOp] = []

    def __enter__(self) -> CommAudit:
        global _recording
        _recording += 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        global _recording
        _recording -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._schema.name.split("::")[-1] in _OP_NAMES:
            self.ops.append(self._inspect(func, args))
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            problem = _device_problem(e, self.device)
            if problem is None:
                raise
            raise DeviceDisciplineError(f"{func}: {problem}. Issued from {_call_site()}") from e

    def _inspect(self, func, args: tuple) -> CommOp:
        name = _OP_NAMES[func._schema.name.split("::")[-1]]
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject)
                     and "ProcessGroup" in str(a._type()))
        group = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(boxed)))
        tensors = _tensors(args)
        site = _call_site()
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise DeviceDisciplineError(
                    f"{name} over ranks {list(group)}: tensor {i} {list(t.shape)} {t.dtype} is "
                    f"on {t.device}, but this run's tensors live on {self.device} (an NCCL "
                    f"group has no backend for {t.device.type} tensors); create it with "
                    f"device=pstate.device. Issued from {site}")
        peer = None
        if name in P2P_OPS:
            peer = group[next(a for a in args if isinstance(a, int))]
        kind = _kind.get()
        if self.groups is not None:
            _check_group(self.groups, kind, name, group, peer, site)
        biggest = max(tensors, key=lambda t: t.numel(), default=None)
        labels = _current.get()
        splits = None
        if name == "all_to_all":  # an empty split list: equal parts
            splits = tuple(tuple(a) or (len(t) // len(group),) * len(group) for a, t in
                           zip((a for a in args if isinstance(a, list)), tensors, strict=False))
        return CommOp(name, group, str(tensors[0].dtype).removeprefix("torch.") if tensors
                      else "-", tuple(tuple(t.shape) for t in tensors),
                      biggest.numel() * biggest.element_size() if biggest is not None else 0,
                      peer, site, labels.take(tensors) if labels is not None else None, kind,
                      splits or None)


def _check_group(groups: Mapping[str, tuple[int, ...]], kind: str | None, name: str,
                 group: tuple[int, ...], peer: int | None, site: str) -> None:
    """Refuse an op whose group (a p2p op: whose peer) is not this rank's group of `kind`."""
    passed = f"ranks {list(group)}" + (f" (peer {peer})" if peer is not None else "")
    if kind is None:
        raise WrongGroupError(f"{name} over {passed} at {site} names no group kind: pass kind= "
                              "to the comms helper, or wrap the torch.distributed call in "
                              "audit.group_kind")
    if kind not in groups:
        raise WrongGroupError(f"{name} at {site} names group kind {kind!r}, which this rank "
                              f"does not have (kinds: {', '.join(groups)})")
    expected = groups[kind]
    wrong = peer not in expected if peer is not None else group != expected
    if wrong:
        raise WrongGroupError(f"{name} at {site} means this rank's {kind} group, ranks "
                              f"{list(expected)}, but was passed {passed}")


def _device_problem(error: BaseException, device: torch.device) -> str | None:
    """What a failed op says about device discipline, in words (None: something else).

    Under an audit an op that mixes a host tensor into the run's device, or reads a meta
    tensor back to the host, fails in torch with a message that names neither the site nor
    the fix; both become a `DeviceDisciplineError` that names them.
    """
    if isinstance(error, DeviceDisciplineError):
        return None
    text = str(error)
    if "is not on the expected device" in text or "Expected all tensors to be on the same" \
            in text:
        return (f"a host tensor meets this run's {device} tensors ({text}); on a GPU that is a "
                "device mismatch or a hidden copy: create it with device=pstate.device")
    if "cannot be called on meta tensors" in text or "Cannot copy out of meta tensor" in text:
        return (f"reads a {device} tensor back to the host ({text}); a dry run has no values: "
                "give it a dry-run path (comms.host_scalar) or keep it on the device")
    return None


def match(records: dict[int, list[CommOp]]) -> str | None:
    """None when the ranks' records fit together, else the first mismatch in words.

    `records` maps global rank -> that rank's ops in issue order, for every rank of the job.
    """
    problems = _match_collectives(records) + _match_p2p(records)
    if problems:
        return min(problems)[1]
    return _deadlock(records)


def _differ(a: CommOp, b: CommOp) -> str:
    """What differs between two ops that should be the same transfer or collective."""
    if (a.op, a.dtype, a.shapes) != (b.op, b.dtype, b.shapes):
        return "op, dtype or shape differ"
    return ("same shapes, different identities: an equal-shape reordering NCCL would "
            "deliver into the wrong buffer")


def _match_collectives(records: dict[int, list[CommOp]]) -> list[tuple[int, str]]:
    """All members of each group issue the same sequence on it: op, dtype, shapes, identity."""
    per_group: dict[tuple[int, ...], dict[int, list[CommOp]]] = defaultdict(dict)
    for rank, ops in records.items():
        for op in ops:
            if op.op not in P2P_OPS:
                per_group[op.group].setdefault(rank, []).append(op)
    problems = []
    for group, by_rank in per_group.items():
        missing = [r for r in group if r not in records]
        if missing:
            problems.append((0, f"group {list(group)}: ranks {missing} were not dry-run; "
                                "use --dry-run-ranks all to match"))
            continue
        lead = group[0]
        for rank in group[1:]:
            mine, theirs = by_rank.get(lead, []), by_rank.get(rank, [])
            for pos in range(max(len(mine), len(theirs))):
                a = mine[pos] if pos < len(mine) else None
                b = theirs[pos] if pos < len(theirs) else None
                if a is not None and b is not None and rank == group[-1] and a.splits:
                    ops = {r: by_rank[r][pos] for r in group if pos < len(by_rank.get(r, []))}
                    why = _unmatched_splits(group, ops) if len(ops) == len(group) else None
                    if why:
                        problems.append((pos, f"group {list(group)}, all_to_all #{pos}: {why}"))
                        break
                if a is None or b is None or _key(a) != _key(b):
                    why = f" ({_differ(a, b)})" if a is not None and b is not None else ""
                    problems.append((pos, f"group {list(group)}, collective #{pos}: rank {lead} "
                                          f"issues {a.describe() if a else 'nothing'}, rank "
                                          f"{rank} issues {b.describe() if b else 'nothing'}"
                                          f"{why}"))
                    break
    return problems


def _key(op: CommOp) -> tuple:
    if op.splits:  # uneven all_to_all rows: widths here, rows by `_unmatched_splits`
        return op.op, op.dtype, tuple(s[1:] for s in op.shapes), op.identity
    return op.op, op.dtype, op.shapes, op.identity


def _unmatched_splits(group: tuple[int, ...], ops: dict[int, CommOp]) -> str | None:
    """The first pair of members of one all_to_all whose rows disagree: member i's rows sent
    to j must be j's rows received from i (uneven under real routing), else None."""
    if any(not op.splits for op in ops.values()):
        return None
    for i, a in enumerate(group):
        for j, b in enumerate(group):
            sent, got = ops[a].splits[1][j], ops[b].splits[0][i]
            if sent != got:
                return (f"rank {a} sends {sent} rows to rank {b}, which receives {got} from it "
                        f"({ops[a].site}; {ops[b].site})")
    return None


def _what(op: CommOp) -> str:
    return f"{describe_identity(op.identity)} {op.payload()}"


def _match_p2p(records: dict[int, list[CommOp]]) -> list[tuple[int, str]]:
    """NCCL's rule, tags ignored: the n-th send from A to B meets the n-th receive on B from
    A, and they must agree on dtype, shapes and identity."""
    sends: dict[tuple[int, int], list[CommOp]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[CommOp]] = defaultdict(list)
    for rank, ops in records.items():
        for op in ops:
            if op.op == "send":
                sends[(rank, op.peer)].append(op)
            elif op.op == "recv":
                recvs[(op.peer, rank)].append(op)
    problems = []
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in records or dst not in records:
            problems.append((0, f"p2p {src} -> {dst}: rank {src if src not in records else dst}"
                                " was not dry-run; use --dry-run-ranks all to match"))
            continue
        out, inc = sends[(src, dst)], recvs[(src, dst)]
        for pos in range(max(len(out), len(inc))):
            a = out[pos] if pos < len(out) else None
            b = inc[pos] if pos < len(inc) else None
            if a is not None and b is not None and (a.dtype, a.shapes, a.identity) == (
                    b.dtype, b.shapes, b.identity):
                continue
            head = f"rank {src} -> rank {dst}: "
            if b is None:
                text = (f"send #{pos} is {_what(a)} but rank {dst} receives nothing "
                        f"more from rank {src} ({len(inc)} receives)")
            elif a is None:
                text = (f"recv #{pos} on rank {dst} expects {_what(b)} but rank {src} "
                        f"sends nothing more to rank {dst} ({len(out)} sends)")
            else:
                why = ("same shapes, different identities: NCCL would deliver it into the "
                       "wrong buffer" if (a.dtype, a.shapes) == (b.dtype, b.shapes)
                       else "dtype or shape differ")
                text = (f"send #{pos} is {_what(a)} but recv #{pos} on rank {dst} "
                        f"expects {_what(b)} ({why})")
            problems.append((pos, head + text))
            break
    return problems


def _events(rank: int, ops: list[CommOp]) -> list[tuple[str, object]]:
    """A rank's blocking events: ("coll", (group, k)) or ("p2p", {(kind, transfer id)}).

    Consecutive p2p ops form one batch (the pipeline posts each exchange as one
    batch_isend_irecv); transfer id ((src, dst), k) names the k-th transfer from src to dst.
    """
    events: list[tuple[str, object]] = []
    colls: dict[tuple[int, ...], int] = defaultdict(int)
    transfers: dict[tuple[str, tuple[int, int]], int] = defaultdict(int)
    batch: set | None = None
    for op in ops:
        if op.op in P2P_OPS:
            pair = (rank, op.peer) if op.op == "send" else (op.peer, rank)
            k = transfers[(op.op, pair)]
            transfers[(op.op, pair)] += 1
            if batch is None:
                batch = set()
                events.append(("p2p", batch))
            batch.add((op.op, (pair, k)))
        else:
            batch = None
            events.append(("coll", (op.group, colls[op.group])))
            colls[op.group] += 1
    return events


def _deadlock(records: dict[int, list[CommOp]]) -> str | None:
    """Play every rank's events with blocking semantics; name the ranks that never finish.

    A collective completes when every member has reached it; a p2p batch completes when each
    of its transfers has met its counterpart in the peer's current batch.
    """
    events = {r: _events(r, ops) for r, ops in records.items()}
    pos = dict.fromkeys(events, 0)
    done: set = set()
    while True:
        current = {r: events[r][pos[r]] for r in events if pos[r] < len(events[r])}
        if not current:
            return None
        for kind, what in current.values():
            if kind != "p2p":
                continue
            for op, (pair, k) in what:
                peer = pair[1] if op == "send" else pair[0]
                other = current.get(peer)
                twin = ("recv" if op == "send" else "send", (pair, k))
                if other is not None and other[0] == "p2p" and twin in other[1]:
                    done.add((pair, k))
        moved = []
        for r, (kind, what) in current.items():
            if kind == "coll":
                ready = all(current.get(m) == ("coll", what) for m in what[0])
            else:
                ready = all(ident in done for _, ident in what)
            if ready:
                moved.append(r)
        if not moved:
            stuck = sorted(current)
            shown = "; ".join(f"rank {r} at event #{pos[r]} ({current[r][0]})" for r in stuck[:4])
            return (f"deadlock: {len(stuck)} ranks wait forever, e.g. {shown}")
        for r in moved:
            pos[r] += 1
