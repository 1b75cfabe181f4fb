"""One spawned job, several layouts: a rank re-forms its process group for another config.

Spawning gloo ranks costs seconds each (every process imports torch); the layouts of a test
module that need the same number of ranks share one `run_ranks` job instead, each rank
calling `regroup` between layouts. The new group goes through `parallel_state.initialize`
(file:// rendezvous), the same path a fresh job takes.
"""

from __future__ import annotations

from pathlib import Path

from megatron_lite.config import Config
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.parallel.state import ParallelState


def regroup(pstate: ParallelState, cfg: Config, rendezvous_dir: str, name: str
            ) -> ParallelState:
    """Tear down this rank's groups and build `cfg`'s over the same ranks; every rank calls
    it with the same `name` (unique within `rendezvous_dir`)."""
    env = LaunchEnv(rank=pstate.rank, local_rank=pstate.rank, world_size=pstate.world_size,
                    local_world_size=pstate.world_size, master_addr="127.0.0.1",
                    master_port=0, source="test", node_rank=0, num_nodes=1)
    parallel_state.destroy(pstate)
    cfg.parallel.distributed_backend = "gloo"
    cfg.parallel.distributed_timeout_minutes = 5
    init = Path(rendezvous_dir) / f"regroup_{name}"
    return parallel_state.initialize(cfg, env=env, init_method=f"file://{init}")
