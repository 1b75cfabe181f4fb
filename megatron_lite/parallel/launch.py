"""Where this process sits in the job: rank, local rank, world size and rendezvous address.

Three launch shapes give the same answer:

* ``torchrun`` (alone, or one torchrun per node inside ``srun --ntasks-per-node=1``): read
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` /
  ``MASTER_PORT``.
* ``srun`` with one task per GPU: read ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS`` and
  derive the master address from the first host of the node list (resolved to IPv4, because
  IPv6-first resolvers make c10d retry forever) and the port from the job id (so two jobs that share
  a node do not collide on a fixed port).
* neither: one process.

This module only reads the environment; it imports nothing beyond the standard library (and the
stdlib-only megatron_lite.errors) so that it can be tested with fake environments and used
before torch is initialised.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_lite.errors import UserError

DEFAULT_PORT = 29500
# Slurm reports the batch script's pseudo step with this id (SLURM_BATCH_SCRIPT).
_BATCH_STEP_IDS = {"4294967294", "batch"}


class LaunchError(UserError, RuntimeError):
    """The job was launched in a way that cannot work; the message shows the right command."""


@dataclass(frozen=True)
class LaunchEnv:
    """The resolved launch layout of this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"
    node_rank: int
    num_nodes: int


# --------------------------------------------------------------------------- node lists


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range_spec(spec: str, nodelist: str) -> list[str]:
    """``01-03,7`` -> ``['01', '02', '03', '7']``; the start's width sets the zero padding."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise ValueError(f"bad range {item!r} in node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in node list {nodelist!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host_pattern(pattern: str, nodelist: str) -> list[str]:
    """Expand one host pattern, possibly with several brackets (``r[1-2]n[01-02]``)."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    prefix, spec, rest = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    tails = _expand_host_pattern(rest, nodelist)
    return [prefix + mid + tail for mid in _expand_range_spec(spec, nodelist) for tail in tails]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list the way ``scontrol show hostnames`` does."""
    hosts: list[str] = []
    for group in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host_pattern(group, nodelist))
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of ``nodelist``: ask ``scontrol`` when it exists (it knows every site syntax)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass  # fall back to our own parser below
    return parse_nodelist(nodelist)


def parse_tasks_per_node(value: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` syntax: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"bad tasks-per-node value {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# --------------------------------------------------------------------------- addresses


def resolve_ipv4(host: str) -> str:
    """First IPv4 address of ``host``; IPv6-first resolvers must not win (c10d then loops)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LaunchError(
            f"cannot resolve master host {host!r} to an IPv4 address ({exc}). "
            f"Set MASTER_ADDR to the head node's IPv4 address, e.g. "
            f"`export MASTER_ADDR=$(getent ahostsv4 {host} | awk 'NR==1{{print $1}}')`."
        ) from exc
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            return str(sockaddr[0])
    raise LaunchError(f"master host {host!r} has no IPv4 address; set MASTER_ADDR to one.")


def port_from_job_id(job_id: str | None) -> int:
    """A per-job port in [10000, 60000) so jobs sharing a node do not fight over one port."""
    if job_id is None or not job_id.isdigit():
        return DEFAULT_PORT
    return 10000 + int(job_id) % 50000


# --------------------------------------------------------------------------- detection


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in _BATCH_STEP_IDS


def _slurm_tasks_on_node(environ: Mapping[str, str], node_id: int) -> int | None:
    """Tasks that Slurm started on node ``node_id`` of this step, when it says."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in environ:
            counts = parse_tasks_per_node(environ[name])
            return counts[node_id] if node_id < len(counts) else counts[-1]
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _int(environ, "SLURM_NTASKS_PER_NODE")
    return None


def _right_commands() -> str:
    return (
        "Launch one of two ways:\n"
        "  (A) one task per GPU, no torchrun:\n"
        "      srun --ntasks-per-node=<gpus per node> --gpus-per-node=<gpus per node> "
        "python pretrain.py ...\n"
        "  (B) one torchrun per node:\n"
        "      srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES "
        "--nproc-per-node=<gpus per node> --rdzv-backend=c10d "
        "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT pretrain.py ..."
    )


def _check_torchrun_inside_srun(environ: Mapping[str, str], env: LaunchEnv) -> None:
    """Catch torchrun started by every task of an srun that already has one task per GPU."""
    if not _in_srun_step(environ) or "SLURM_NTASKS" not in environ:
        return
    ntasks = _int(environ, "SLURM_NTASKS")
    is_elastic = "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ
    if not is_elastic:
        # RANK/WORLD_SIZE mapped by hand from SLURM_PROCID/SLURM_NTASKS (shape A).
        if env.world_size != ntasks:
            raise LaunchError(
                f"WORLD_SIZE={env.world_size} but srun started SLURM_NTASKS={ntasks} tasks; "
                f"set WORLD_SIZE=$SLURM_NTASKS or unset RANK/WORLD_SIZE.\n{_right_commands()}"
            )
        return
    node_id = int(environ.get("SLURM_NODEID", "0"))
    per_node = _slurm_tasks_on_node(environ, node_id)
    if per_node is not None and per_node > 1:
        raise LaunchError(
            f"torchrun is running inside an srun step that starts {per_node} tasks on this node "
            f"(SLURM_NTASKS={ntasks}): every task starts its own torchrun, so the node runs "
            f"{per_node} x {env.local_world_size} processes fighting over one port.\n"
            f"{_right_commands()}"
        )
    expected = ntasks * env.local_world_size
    if env.world_size != expected:
        raise LaunchError(
            f"torchrun WORLD_SIZE={env.world_size} disagrees with SLURM_NTASKS={ntasks} x "
            f"LOCAL_WORLD_SIZE={env.local_world_size} = {expected} (was torchrun started with "
            f"--standalone or a wrong --nnodes inside a multi-node srun?).\n{_right_commands()}"
        )


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(environ, "WORLD_SIZE")
    if "LOCAL_WORLD_SIZE" in environ:
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE")
    else:  # RANK/WORLD_SIZE mapped by hand under srun, or a bare single-node launch
        node_id = int(environ.get("SLURM_NODEID", "0"))
        local_world_size = _slurm_tasks_on_node(environ, node_id) or world_size
    if "GROUP_WORLD_SIZE" in environ:
        num_nodes = _int(environ, "GROUP_WORLD_SIZE")
    else:
        num_nodes = max(1, world_size // max(1, local_world_size))
    env = LaunchEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_PORT,
        source="torchrun",
        node_rank=_int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0,
        num_nodes=num_nodes,
    )
    _check_torchrun_inside_srun(environ, env)
    return env


def _slurm_master(environ: Mapping[str, str]) -> tuple[str, int]:
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    else:
        nodelist = next(
            (
                environ[k]
                for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if k in environ
            ),
            None,
        )
        if nodelist is None:
            raise LaunchError(
                "under srun but SLURM_JOB_NODELIST is not set; export MASTER_ADDR=<head node IPv4>."
            )
        addr = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    else:
        port = port_from_job_id(environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID")))
    return resolve_ipv4(addr), port


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(environ, "SLURM_NTASKS")
    if world_size > 1 and not _in_srun_step(environ):
        raise LaunchError(
            f"this is the batch script of a {world_size}-task Slurm job, not an srun step: "
            f"running pretrain.py directly would wait forever for the other "
            f"{world_size - 1} ranks.\n{_right_commands()}"
        )
    node_rank = int(environ.get("SLURM_NODEID", "0"))
    num_nodes = int(environ.get("SLURM_NNODES", environ.get("SLURM_JOB_NUM_NODES", "1")))
    local_world_size = _slurm_tasks_on_node(environ, node_rank)
    if local_world_size is None:
        local_world_size = max(1, world_size // max(1, num_nodes))
    addr, port = _slurm_master(environ)
    return LaunchEnv(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=port,
        source="slurm",
        node_rank=node_rank,
        num_nodes=num_nodes,
    )


def launch_identity(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(rank, which launch) a process's environment says it is, read in `detect_launch_env`'s
    order without resolving anything: torchrun's RANK with its MASTER_ADDR:MASTER_PORT, else
    srun's SLURM_PROCID with its job and step id; None for neither. Two processes of one job
    step share the second part, so a pid can be matched to a rank of this job (the watchdog
    kills a frozen peer only then) whichever launcher started them."""
    if environ.get("RANK", "").isdigit() and "WORLD_SIZE" in environ:
        where = f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', DEFAULT_PORT)}"
        return int(environ["RANK"]), "torchrun " + where
    if environ.get("SLURM_PROCID", "").isdigit() and "SLURM_NTASKS" in environ:
        job = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", ""))
        step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
        return int(environ["SLURM_PROCID"]), f"slurm {job}.{step}"
    return None


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Resolve the launch layout: torchrun variables, then Slurm, then a single process."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _from_slurm(environ)
    return LaunchEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_PORT,
        source="single",
        node_rank=0,
        num_nodes=1,
    )


def check_devices_per_node(env: LaunchEnv, device_count: int) -> None:
    """More ranks on a node than GPUs means ranks would share a GPU (or index past the last)."""
    if device_count <= 0:
        return
    if env.local_world_size > device_count or env.local_rank >= device_count:
        raise LaunchError(
            f"node {env.node_rank} runs {env.local_world_size} ranks (local rank "
            f"{env.local_rank}, source={env.source}) but has {device_count} GPUs. Start exactly "
            f"one rank per GPU: --ntasks-per-node={device_count} with srun, or "
            f"--nproc-per-node={device_count} with torchrun.\n{_right_commands()}"
        )


def check_tp_within_node(env: LaunchEnv, tp: int, allowed: bool = False) -> None:
    """A TP group (tp consecutive ranks) must sit on one node: its all-reduces run in every
    layer, and over the network instead of NVLink they are many times slower. The verdict is
    the same on every rank (it depends on the layout only), so rank 0 alone reports it."""
    per_node = env.local_world_size
    if allowed or tp <= 1 or env.num_nodes <= 1 or per_node % tp == 0:
        return
    group = next((k for k in range(0, env.world_size, tp)
                  if k // per_node != (k + tp - 1) // per_node), 0)
    fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
    raise LaunchError(
        f"--tensor-model-parallel-size {tp} does not divide the {per_node} ranks per node "
        f"({env.num_nodes} nodes, launched by {env.source}), so tensor-parallel groups span "
        f"nodes (e.g. ranks {group}-{group + tp - 1}) and every layer's all-reduce crosses the "
        f"network. Use a TP size that divides {per_node} ({', '.join(map(str, fits))}), or "
        "pass --allow-tp-across-nodes if that is what you want."
    )


def rendezvous_error(env: LaunchEnv, cause: BaseException, timeout_minutes: float) -> LaunchError:
    """What a failed or timed-out rendezvous means for this launch, and what to check."""
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    endpoint = {
        "slurm": "MASTER_ADDR (default: the first host of SLURM_JOB_NODELIST) and MASTER_PORT "
                 "(default: from SLURM_JOB_ID)",
        "torchrun": "torchrun's --rdzv-endpoint (or --master-addr / --master-port) and "
                    "--nnodes x --nproc-per-node",
    }.get(env.source, "MASTER_ADDR and MASTER_PORT")
    return LaunchError(
        f"rendezvous failed: rank {env.rank} of world size {env.world_size} could not meet the "
        f"others at {env.master_addr}:{env.master_port} within --distributed-timeout-minutes "
        f"{timeout_minutes:g} (launched by {env.source}): {first}. Check that rank 0 started "
        f"and is not stuck before the rendezvous (its output), that all {env.world_size} ranks "
        f"were started, that {env.master_addr} is rank 0's host and port {env.master_port} is "
        f"reachable from this node (firewall, another job on it), and {endpoint}."
    )


# --------------------------------------------------------------------------- port check


def _port_holder_psutil(port: int) -> str | None:
    try:
        import psutil  # optional: gives the holder on every OS
    except ImportError:
        return None
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.pid is not None:
                proc = psutil.Process(conn.pid)
                return f"pid {conn.pid} ({' '.join(proc.cmdline()) or proc.name()})"
    except (psutil.Error, OSError):
        return None
    return None


def _socket_inodes_on_port(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # header
                for line in f:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    inodes.discard("0")
    return inodes


def _port_holder_proc(port: int) -> str | None:
    """Linux without psutil: map the port's socket inode to a pid through /proc/*/fd."""
    targets = {f"socket:[{inode}]" for inode in _socket_inodes_on_port(port)}
    if not targets:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in targets for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({cmd})"
        except OSError:
            continue  # process exited or is not ours
    return None


def port_holder(port: int) -> str | None:
    """Describe the process that holds ``port``, or None when it cannot tell."""
    return _port_holder_psutil(port) or _port_holder_proc(port)


def check_port_free(addr: str, port: int) -> None:
    """Rank 0, before rendezvous: fail fast, naming the holder, if the port is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option as the c10d TCPStore, so a port in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                sock.bind((addr, port))
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                sock.bind(("", port))  # addr is not on this host's interfaces
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            holder = port_holder(port) or "a process this user cannot see"
            raise LaunchError(
                f"rendezvous port {addr}:{port} is already in use by {holder}. Stop it, or pick "
                f"another port: `export MASTER_PORT=<free port>` (torchrun: --master-port)."
            ) from exc
