"""Launch mistakes refused by name before the rendezvous, on the training path: a TP group
across nodes, more ranks on a node than GPUs, a busy master port; and a rendezvous that fails
explained with address, port, world size and launcher. In process (a poisoned
init_process_group proves nothing reached the rendezvous) and through the fake Slurm stubs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv, LaunchError, check_tp_within_node

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tests" / "scripts" / "slurm_stubs"
TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4",
        "--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1",
        "--train-iters", "1", "--eval-iters", "0", "--ffn-hidden-size", "64"]


def _env(rank: int = 0, world: int = 8, per_node: int = 4, port: int = 29500) -> LaunchEnv:
    return LaunchEnv(rank=rank, local_rank=rank % per_node, world_size=world,
                     local_world_size=per_node, master_addr="127.0.0.1", master_port=port,
                     source="slurm", node_rank=rank // per_node, num_nodes=world // per_node)


@pytest.fixture
def no_rendezvous(monkeypatch):
    """init_process_group fails the test if called: the check had to come first."""
    def init(*args, **kwargs):
        raise AssertionError("the rendezvous was reached")

    monkeypatch.setattr(parallel_state.dist, "init_process_group", init)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def test_tp_across_nodes_rule():
    check_tp_within_node(_env(), 4)  # 4 per node: TP 4 and 2 fit
    check_tp_within_node(_env(), 2)
    check_tp_within_node(_env(world=4, per_node=4), 8)  # one node: nothing to span
    check_tp_within_node(_env(), 8, allowed=True)
    with pytest.raises(LaunchError, match=r"ranks 0-7\b.*divides 4 \(1, 2, 4\)") as info:
        check_tp_within_node(_env(), 8)
    assert "--allow-tp-across-nodes" in str(info.value)
    with pytest.raises(LaunchError, match="ranks 3-5"):  # 3 does not tile 4 ranks per node
        check_tp_within_node(_env(world=12, per_node=4), 3)


@pytest.mark.quick
def test_tp_across_nodes_refused_before_rendezvous(no_rendezvous):
    cfg = parse_config([*TINY, "--tensor-model-parallel-size", "8"])
    with pytest.raises(LaunchError, match="--allow-tp-across-nodes"):
        parallel_state.initialize(cfg, _env(rank=5))
    cfg = parse_config([*TINY, "--tensor-model-parallel-size", "8", "--allow-tp-across-nodes",
                        "--distributed-backend", "gloo"])
    with pytest.raises(AssertionError, match="rendezvous was reached"):
        parallel_state.initialize(cfg, _env(rank=5))


def test_more_ranks_per_node_than_gpus_refused_before_rendezvous(no_rendezvous, monkeypatch):
    torch = parallel_state.torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cfg = parse_config(TINY)  # backend auto -> nccl
    with pytest.raises(LaunchError, match=r"runs 4 ranks .* has 2 GPUs.*--ntasks-per-node=2"):
        parallel_state.initialize(cfg, _env(rank=1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(AssertionError, match="rendezvous was reached"):
        parallel_state.initialize(cfg, _env(rank=1))
    cfg = parse_config([*TINY, "--distributed-backend", "cuda:gloo"])  # shares GPUs on purpose
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(AssertionError, match="rendezvous was reached"):
        parallel_state.initialize(cfg, _env(rank=1))


def test_busy_port_refused_by_rank_0_before_rendezvous(no_rendezvous):
    cfg = parse_config([*TINY, "--distributed-backend", "gloo"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(LaunchError, match=f"127.0.0.1:{port} is already in use") as info:
            parallel_state.initialize(cfg, _env(rank=0, port=port))
        assert f"pid {os.getpid()}" in str(info.value)  # the holder, by /proc
        with pytest.raises(AssertionError, match="rendezvous was reached"):
            parallel_state.initialize(cfg, _env(rank=1, port=port))  # only rank 0 binds it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_timeout_is_explained(monkeypatch):
    """Rank 1 of 2 with nobody at the port: address, port, world size, launcher, what to check."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = parse_config([*TINY, "--distributed-backend", "gloo",
                        "--distributed-timeout-minutes", "0.01"])
    port = _free_port()
    env = _env(rank=1, world=2, per_node=2, port=port)
    with pytest.raises(LaunchError) as info:
        parallel_state.initialize(cfg, env)
    text = str(info.value)
    for part in ("rank 1 of world size 2", f"127.0.0.1:{port}", "launched by slurm",
                 "SLURM_JOB_NODELIST", "rank 0 started", "--distributed-timeout-minutes 0.01"):
        assert part in text, text
    assert getattr(info.value, "found_on_rank", None) == 1  # each stuck rank reports itself


# ---------------------------------------------------------------- through the srun stub


def _srun(flags: list[str], tmp_path: Path, per_node: int = 2, **extra: str
          ) -> subprocess.CompletedProcess:
    """`srun --nodes=2 --ntasks-per-node=N --kill-on-bad-exit python pretrain.py TINY flags`
    on fake Slurm (as real jobs do: the ranks left waiting for a refused rank 0 end too)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PATH=f"{STUBS}:{env['PATH']}", FAKE_SLURM_HOSTS="127.0.0.1,127.0.0.2",
               SLURM_JOB_ID="424242", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    return subprocess.run(["srun", "--nodes=2", f"--ntasks-per-node={per_node}",
                           "--kill-on-bad-exit",
                           sys.executable,
                           "pretrain.py", *TINY, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_srun_refuses_tp_across_nodes_and_a_busy_port(tmp_path):
    proc = _srun(["--tensor-model-parallel-size", "4"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "--allow-tp-across-nodes" in errors[0], proc.stderr[-3000:]
    assert "ranks 0-3" in errors[0] and "2 ranks per node" in errors[0]
    assert "Traceback" not in proc.stderr

    with socket.socket() as holder:  # rank 0 refuses; srun ends the other node's rank
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = _srun([], tmp_path, per_node=1, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and f"127.0.0.1:{port} is already in use" in errors[0], errors
    assert f"pid {os.getpid()}" in errors[0] and "MASTER_PORT" in errors[0]
