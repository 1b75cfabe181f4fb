"""The in-process scenarios run once per session (one spawn of two ranks); test_scenarios
checks them and compares its whole-process faults with their uninterrupted baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoint.common import flip_tensor_byte
from tests.distributed import run_ranks
from tests.reliability.common import BASE, CORRUPTED, bad_corpora, run_train

S16 = ["--train-iters", "16", "--spike-threshold", "5"]


def _scenarios(pstate, tmp: str) -> dict:
    t = Path(tmp)
    r: dict = {"baseline": run_train(pstate, [*BASE, "--save", f"{t}/base"])}
    # A step skipped by --skip-iterations, by NaN/Inf (gradient / loss) and by a spike must
    # all leave the same state behind: batch consumed, no update, no Adam step.
    r["skip"] = run_train(pstate, [*S16, "--skip-iterations", "6", "14",
                                   "--log-jsonl", f"{t}/skip.jsonl"])
    for kind in ("nan_grad", "nan_loss"):
        r[kind] = run_train(pstate, [*S16, "--save", f"{t}/{kind}", "--save-interval", "1"],
                            fault=f"rank1:iter6:{kind},rank1:iter14:spike")
    r["stop"] = run_train(pstate, [*BASE, "--save", f"{t}/stop", "--on-nan", "stop"],
                          fault="rank1:iter8:nan_grad")
    term = [*BASE, "--save", f"{t}/term"]
    r["term1"] = run_train(pstate, term, fault="rank1:iter7:sigterm")
    r["term2"] = run_train(pstate, term, fault="rank0:iter10:sigterm_in_save")
    r["term3"] = run_train(pstate, term)
    r["time"] = run_train(pstate, ["--train-iters", "20", "--exit-duration-in-mins", "1e-6",
                                   "--save", f"{t}/time"])
    rollback = ["--train-iters", "16", "--save-interval", "5", "--spike-threshold", "5",
                "--on-spike", "rollback", "--spike-patience", "2", "--spike-lr-iters", "6"]
    r["rollback"] = run_train(pstate, [*rollback, "--save", f"{t}/rb", "--log-jsonl",
                                       f"{t}/rb.jsonl"], fault="rank1:iter12-13:spike")
    # Resumed inside the lowered-LR window (through 16): the guard's state comes back.
    r["rollback_resumed"] = run_train(pstate, [*rollback, "--load", f"{t}/rb", "--ckpt-step",
                                               "15", "--save", f"{t}/rb2", "--log-jsonl",
                                               f"{t}/rb2.jsonl"])
    if pstate.rank == 0:  # one flipped bit inside the tensor data of the newest checkpoint
        flip_tensor_byte(t / "base" / "iter_0000020" / CORRUPTED)
    dist.barrier()
    again = ["--train-iters", "20", "--save", f"{t}/base"]
    r["corrupt_stop"] = run_train(pstate, [*again, "--no-ckpt-fallback"])
    r["corrupt"] = run_train(pstate, again)
    for name in ("ids", "truncated"):
        r[f"data_{name}"] = run_train(pstate, ["--train-iters", "2", "--data-path",
                                               f"{t}/data/{name}", "--split", "100,0,0"])
    return r


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("reliability")
    (tmp / "data").mkdir()
    bad_corpora(tmp / "data")
    return run_ranks(_scenarios, 2, tmp, tmp=str(tmp), timeout=240), tmp


