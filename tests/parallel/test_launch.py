"""Launch-environment mapping with fake environments: no Slurm, no network, no torch."""

from __future__ import annotations

import os
import socket

import pytest

from megatron_lite.parallel import launch
from megatron_lite.parallel.launch import (
    LaunchEnv,
    LaunchError,
    check_devices_per_node,
    check_port_free,
    detect_launch_env,
    parse_nodelist,
    parse_tasks_per_node,
    port_from_job_id,
    resolve_ipv4,
)


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch):
    """Use our own node-list parser even on a machine that has Slurm installed."""
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)


@pytest.fixture
def fake_dns(monkeypatch):
    """A resolver that answers IPv6 first, like the ones that break c10d rendezvous."""
    table = {"node01": "10.0.0.1", "gpu-a1": "10.0.1.1"}
    calls = []

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        calls.append((host, family))
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 0, 0, 0))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], 0))
        return [v4] if family == socket.AF_INET else [v6, v4]

    monkeypatch.setattr(launch.socket, "getaddrinfo", getaddrinfo)
    return calls


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1],b", ["a1", "b"]),
    ],
)
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1", "node[3-1]", "node[a-b]"])
def test_parse_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="node list"):
        parse_nodelist(bad)


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8") == [8]


def test_port_from_job_id():
    assert port_from_job_id("123456") == 10000 + 123456 % 50000
    assert port_from_job_id("49999") != port_from_job_id("50001")
    assert port_from_job_id(None) == launch.DEFAULT_PORT


def test_ipv6_first_resolver_gives_ipv4(fake_dns):
    # The unrestricted answer leads with IPv6; we must ask for AF_INET and get the v4 address.
    assert socket.getaddrinfo("node01", None)[0][0] == socket.AF_INET6
    assert resolve_ipv4("node01") == "10.0.0.1"
    assert fake_dns[-1] == ("node01", socket.AF_INET)


def test_unresolvable_master_names_the_fix(fake_dns):
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        resolve_ipv4("nosuchhost")


def _slurm_env(**over):
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu-a[1-2]",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "777777",
        "SLURM_STEP_ID": "0",
    }
    env.update(over)
    return env


def test_slurm_one_task_per_gpu(fake_dns):
    env = detect_launch_env(_slurm_env())
    assert env == LaunchEnv(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        master_addr="10.0.1.1",
        master_port=10000 + 777777 % 50000,
        source="slurm",
        node_rank=1,
        num_nodes=2,
    )


def test_slurm_respects_master_overrides(fake_dns):
    env = detect_launch_env(_slurm_env(MASTER_ADDR="node01", MASTER_PORT="6000"))
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 6000)


def test_slurm_uneven_tasks_per_node(fake_dns):
    env = detect_launch_env(
        _slurm_env(SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="3,2", SLURM_PROCID="4")
    )
    assert env.local_world_size == 2


def test_batch_script_without_srun_is_refused(fake_dns):
    environ = _slurm_env()
    del environ["SLURM_STEP_ID"]
    with pytest.raises(LaunchError, match="not an srun step"):
        detect_launch_env(environ)


def test_torchrun_and_single():
    tr = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "x",
    }
    env = detect_launch_env(tr)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.source, env.master_port) == (1, 2, "torchrun", 29511)
    single = detect_launch_env({})
    assert (single.source, single.rank, single.world_size) == ("single", 0, 1)


def test_torchrun_and_slurm_give_the_same_ranks(fake_dns):
    """Shape B (one torchrun per node inside srun) and shape A map to the same grid."""
    shape_a = detect_launch_env(_slurm_env(SLURM_PROCID="6", SLURM_LOCALID="2"))
    shape_b = detect_launch_env(
        _slurm_env(
            SLURM_NTASKS="2",
            SLURM_PROCID="1",
            SLURM_LOCALID="0",
            SLURM_TASKS_PER_NODE="1(x2)",
            RANK="6",
            WORLD_SIZE="8",
            LOCAL_RANK="2",
            LOCAL_WORLD_SIZE="4",
            GROUP_RANK="1",
            MASTER_ADDR="10.0.1.1",
            MASTER_PORT=str(10000 + 777777 % 50000),
            TORCHELASTIC_RUN_ID="j",
        )
    )
    keys = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "master_addr")
    assert [getattr(shape_a, k) for k in keys] == [getattr(shape_b, k) for k in keys]


def _torchrun_in_srun(**over):
    """torchrun --nproc-per-node=4 started by every task of a 4-tasks-per-node srun."""
    env = _slurm_env(
        RANK="1",
        WORLD_SIZE="4",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="4",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID="none",
    )
    env.update(over)
    return env


def test_torchrun_inside_multi_task_srun_is_refused():
    with pytest.raises(LaunchError, match="torchrun is running inside an srun") as info:
        detect_launch_env(_torchrun_in_srun())
    assert "srun --ntasks-per-node=1 torchrun" in str(info.value)
    assert "python pretrain.py" in str(info.value)


def test_torchrun_world_disagreeing_with_srun_is_refused():
    # One task per node (correct), but torchrun --standalone built a one-node world.
    environ = _torchrun_in_srun(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="1(x2)")
    with pytest.raises(LaunchError, match="WORLD_SIZE=4 disagrees with SLURM_NTASKS=2"):
        detect_launch_env(environ)


def test_hand_mapped_rank_with_wrong_world_is_refused():
    environ = _slurm_env(RANK="5", WORLD_SIZE="4", LOCAL_RANK="1")
    with pytest.raises(LaunchError, match="WORLD_SIZE=4 but srun started SLURM_NTASKS=8"):
        detect_launch_env(environ)


def test_more_ranks_than_gpus_is_refused(fake_dns):
    env = detect_launch_env(_slurm_env())  # 4 tasks per node
    check_devices_per_node(env, 4)
    with pytest.raises(LaunchError, match="--ntasks-per-node=2"):
        check_devices_per_node(env, 2)


def test_busy_port_names_the_holder():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(LaunchError, match=f"127.0.0.1:{port} is already in use") as info:
            check_port_free("127.0.0.1", port)
        if os.path.isdir("/proc/self/fd"):
            assert f"pid {os.getpid()}" in str(info.value)
    check_port_free("127.0.0.1", port)  # released: free again
