"""FLOPs against hand computations, peak table, MFU on a CPU run, wandb (fake and real offline),
per-rank timing and the straggler warning with one sleeping rank."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from megatron_lite import devices, metrics
from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, ModelConfig, TrainConfig
from megatron_lite.metrics import (
    JSONL_TRAIN_KEYS,
    MetricsLogger,
    StepRecord,
    StragglerDetector,
    detect_peak_tflops,
    peak_line,
    rank_spread,
    resolve_wandb_mode,
)
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planner import (
    Cluster,
    Layout,
    ModelShape,
    Recompute,
    evaluate,
    matmul_params,
    training_flops_per_token,
)
from megatron_lite.training import build_model, train
from tests.distributed import run_ranks

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "1"]

# ---------------------------------------------------------------- FLOPs, by hand


def test_gpt3_175b_by_hand() -> None:
    """GPT-3 175B: 96 layers, h = 12288, 96 heads x 128, plain GELU MLP 4h, vocab 50257
    (tied, so the embedding counts once, as the output layer), s = 2048."""
    h, layers, s, v = 12288, 96, 2048, 50257
    qkv = h * 3 * h                    # 452,984,832
    proj = h * h                       # 150,994,944
    mlp = 2 * h * 4 * h                # 1,207,959,552
    per_layer = qkv + proj + mlp       # 12 h^2 = 1,811,939,328
    n = layers * per_layer + v * h          # 173,946,175,488 + 617,558,016
    assert n == 174_563_733_504        # ~175B, as the name says
    headline = 6 * n + 12 * layers * h * s  # 1,047,382,401,024 + 28,991,029,248
    causal = 6 * n + 6 * layers * h * s
    shape = ModelShape(layers=layers, hidden=h, ffn_hidden=4 * h, heads=96, query_groups=96,
                       head_dim=128, vocab=v, gated_mlp=False)
    assert matmul_params(shape) == n
    assert training_flops_per_token(shape, s) == headline == 1_076_373_430_272
    assert training_flops_per_token(shape, s, causal=True) == causal == 1_061_877_915_648
    # The paper's 3.14e23 FLOPs for 300B tokens is 6N with N = 175B: 1.05e12 per token.
    assert abs(6 * n / (3.14e23 / 300e9) - 1) < 0.01


def test_llama2_7b_and_70b_by_hand() -> None:
    """SwiGLU (three h x f matrices), untied output layer, and for 70B GQA with 8 KV heads.
    Adding back the input embedding and the RMSNorm weights must give the published counts."""
    # Llama-2 7B: 32 layers, h = 4096, 32 heads (= KV heads) x 128, f = 11008, V = 32000, s = 4096
    h, layers, f, v, s = 4096, 32, 11008, 32000, 4096
    attn = h * (h + 2 * h) + h * h            # q, k, v, o = 67,108,864
    mlp = 3 * h * f                           # 135,266,304
    n = layers * (attn + mlp) + v * h              # 6,476,005,376 + 131,072,000
    assert n + v * h + (2 * layers + 1) * h == 6_738_415_616  # HF Llama-2-7b-hf parameter count
    shape = ModelShape(layers=layers, hidden=h, ffn_hidden=f, heads=32, query_groups=32,
                       head_dim=128, vocab=v)
    assert matmul_params(shape) == n == 6_607_077_376
    assert training_flops_per_token(shape, s) == 6 * n + 12 * layers * h * s == 46_084_915_200
    assert training_flops_per_token(shape, s, causal=True) == 6 * n + 6 * layers * h * s \
        == 42_863_689_728
    # Llama-2 70B: 80 layers, h = 8192, 64 query heads, 8 KV groups x 128, f = 28672
    h, layers, f = 8192, 80, 28672
    kv = 8 * 128
    attn = h * (h + 2 * kv) + h * h           # 150,994,944 (GQA: k and v are 8x smaller)
    n = layers * (attn + 3 * h * f) + v * h
    assert n + v * h + (2 * layers + 1) * h == 68_976_648_192  # HF Llama-2-70b-hf
    shape = ModelShape(layers=layers, hidden=h, ffn_hidden=f, heads=64, query_groups=8,
                       head_dim=128, vocab=v)
    assert matmul_params(shape) == n
    assert training_flops_per_token(shape, 4096) == 6 * n + 12 * layers * h * 4096


@pytest.mark.parametrize("untie", [False, True])
def test_matmul_params_match_the_built_model(untie: bool) -> None:
    """Every 2-D weight of our model is a matmul weight, except the input embedding when the
    output layer is separate."""
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_query_groups=2, vocab_size=200,
                                   untie_embeddings_and_output_weights=untie))
    pstate = _single_state(cfg)
    weights = {n: p.numel() for chunk in build_model(cfg, pstate)
               for n, p in chunk.named_parameters() if p.dim() == 2}
    counted = sum(weights.values()) - (weights["embedding.weight"] if untie else 0)
    assert matmul_params(ModelShape.from_config(cfg.model)) == counted


# ---------------------------------------------------------------- peak, memory, stragglers


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA H100 PCIe", 756.0), ("NVIDIA B200", 2250.0),
                                       ("AMD Instinct MI300X", 1307.4)])
def test_peak_by_gpu_name(monkeypatch, name: str, peak: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    bf16, fp32 = TrainConfig(bf16=True), TrainConfig()
    found = detect_peak_tflops(torch.device("cuda", 0), bf16, None)
    assert found == (peak, f"bfloat16 dense, table ({name})")
    # an fp32 model's GEMMs are divided by the fp32 peak, not bf16's (~15x more)
    assert detect_peak_tflops(torch.device("cuda", 0), fp32, None)[0] < peak / 7
    assert detect_peak_tflops(torch.device("cuda", 0), bf16, 500.0)[0] == 500.0
    # under FP8 the line says MFU is still against the bf16 peak, unless --peak-tflops is given
    assert peak_line(found, fp8=True) == (f"MFU peak: {peak:.4g} TFLOP/s (bfloat16 dense, table "
                                          f"({name})); the FP8 GEMMs are counted against this "
                                          "bf16 peak (--peak-tflops for another)")
    assert peak_line((2000.0, "--peak-tflops"), fp8=True) == (
        "MFU peak: 2000 TFLOP/s (--peak-tflops)")


def test_an_unknown_gpu_gets_no_made_up_peak(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X9000")
    peak, source = detect_peak_tflops(torch.device("cuda", 0), TrainConfig(bf16=True), None)
    assert peak != peak and "pass --peak-tflops" in source  # nan: MFU not computed


def test_an_emulated_bf16_cpu_is_named_with_its_slowdown(monkeypatch) -> None:
    """A CPU whose bf16 matmul runs 40x below fp32 (an AVX2 part without AVX-512 BF16): the
    peak is still bf16's (so MFU stays <= 100%), and the line says to drop --bf16."""
    rates = {torch.bfloat16: 0.005, torch.float32: 0.2}
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", lambda dtype: rates[dtype])
    monkeypatch.setattr(devices, "measure_cpu_peak_tflops", lambda dtype: rates[dtype])
    peak, source = detect_peak_tflops(torch.device("cpu"), TrainConfig(bf16=True), None)
    assert peak == 0.005
    assert "bf16 matmul is emulated on this CPU (40x slower than fp32)" in source
    rates[torch.bfloat16] = 0.4  # native: no note
    assert "emulated" not in detect_peak_tflops(torch.device("cpu"), TrainConfig(bf16=True),
                                                None)[1]


ROOT = Path(__file__).resolve().parents[1]
_RSS_PROBE = """
import json, torch
from megatron_lite.metrics import memory_stats
before = memory_stats(torch.device("cpu"))
block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
print(json.dumps([before, memory_stats(torch.device("cpu"))]))
"""


def test_cpu_memory_is_the_resident_set() -> None:
    """Now and peak go up with a touched block, in a process whose parent peaked higher.

    A fresh process, because this worker's own peak may already be far above its current
    set; the 512 MiB parent peak checks that the child reports its own peak, not the
    parent's (getrusage's peak survives exec)."""
    parent_peak = torch.ones(512 * 2**20 // 4)
    del parent_peak
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    before, after = json.loads(out.splitlines()[-1])
    assert after["rss_gib"] - before["rss_gib"] > 0.2, (before, after)
    assert after["max_rss_gib"] - before["max_rss_gib"] > 0.2, (before, after)  # a new peak


def test_straggler_needs_several_intervals_in_a_row() -> None:
    det = StragglerDetector(threshold=0.10, intervals=3)
    slow = [1.0, 1.0, 1.5, 1.0]                     # rank 2 is 50% above the median 1.0
    assert det.update(slow) == [] and det.update(slow) == []
    assert det.update([1.0, 1.0, 1.05, 1.0]) == []  # 5%: under the threshold, streak resets
    assert det.update(slow) == [] and det.update(slow) == []
    assert det.update(slow) == [(2, 0.5, 3)]
    assert det.update(slow) == [] and det.update(slow) == []
    assert det.update(slow) == [(2, 0.5, 6)]        # repeated while it lasts
    spread = rank_spread(slow, ["a", "b", "c", "d"])
    assert (spread.min_s, spread.median_s, spread.max_s) == (1.0, 1.0, 1.5)
    assert (spread.slowest_rank, spread.slowest_host) == (2, "c")


def test_wandb_mode_resolution(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    assert resolve_wandb_mode("disabled", {"WANDB_API_KEY": "k"})[0] == "disabled"
    assert resolve_wandb_mode(None, {"WANDB_MODE": "offline", "WANDB_API_KEY": "k"})[0] == \
        "offline"
    assert resolve_wandb_mode(None, {"WANDB_API_KEY": "k"})[0] == "online"
    assert resolve_wandb_mode(None, {})[0] == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert resolve_wandb_mode(None, {}) == ("online", "~/.netrc has api.wandb.ai")


# ---------------------------------------------------------------- logger and training runs


def _single_state(cfg: Config) -> ParallelState:
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    master_addr="127.0.0.1", master_port=0, source="test", node_rank=0,
                    num_nodes=1)
    return parallel_state.initialize(cfg, env)


@pytest.mark.quick
@pytest.mark.parametrize("dtype_flags,dtype", [([], "float32"), (["--bf16"], "bfloat16")])
def test_mfu_of_a_cpu_run_is_against_the_measured_peak(tmp_path, dtype_flags: list[str],
                                                       dtype: str) -> None:
    """No --peak-tflops: the peak is measured with a matmul of the model's GEMM dtype, as a
    real CPU run does (a bf16 peak under an fp32 model read MFU 7,560% on an emulating CPU)."""
    jsonl = tmp_path / "m.jsonl"
    cfg = parse_config([*FLAGS, *dtype_flags, "--train-iters", "4", "--log-interval", "2",
                        "--eval-interval", "4", "--log-jsonl", str(jsonl)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg, _single_state(cfg))
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    trains = [r for r in records if "loss" in r]
    assert [tuple(r) for r in trains] == [JSONL_TRAIN_KEYS] * 2
    assert [r["iteration"] for r in trains] == [2, 4]
    fpt = training_flops_per_token(ModelShape.from_config(cfg.model), 16)
    text = out.getvalue()
    found = re.search(rf"MFU peak: ([0-9.e+-]+) TFLOP/s \({dtype} dense, measured {dtype} matmul",
                      text)
    assert found, text
    peak = float(found.group(1))
    # The peak is the fastest single matmul of its window, so a descheduled moment cannot lower
    # it (the mean did: MFU 1.28 was seen); a tiny model's step runs far below it.
    for r in trains:
        assert 0 < r["mfu"] <= 1
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / peak, rel=1e-3)
        assert r["tflops_per_device"] == pytest.approx(r["tokens_per_sec"] * fpt / 1e12)
        assert r["tokens_per_sec"] == pytest.approx(4 * 16 / (r["iter_time_ms"] / 1e3))
    assert list(records[-1]) == ["iteration", "eval_loss", "eval_ppl"]
    assert "| skipped 0 | mem rss " in text and "(causal " in text


DEMO_MODEL = ["--num-layers", "4", "--hidden-size", "192", "--num-attention-heads", "4",
              "--seq-length", "128"]
DEMO_BATCH = ["--micro-batch-size", "16"]
"""scripts/demo.sh's model and micro-batch; its tokenizer has VOCAB=4096 pieces."""


def test_planner_and_log_agree_on_flops_and_mfu_for_the_demo() -> None:
    """One FLOP count: for the demo's model the planner's FLOPs per token are the ones the
    MetricsLogger divides by, and the same tokens/s, peak and world size give the same MFU."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert " ".join(DEMO_MODEL) in demo and " ".join(DEMO_BATCH) in demo and "VOCAB=4096" in demo
    cfg = parse_config(["--mock-data", *DEMO_MODEL, *DEMO_BATCH, "--vocab-size", "4096"])
    cluster = Cluster(gpus=1, peak_tflops=2.0)
    layout = Layout(tp=1, pp=1, dp=1, chunks=1, micro_batch=16, sharding="no_shard",
                    recompute=Recompute(), sequence_parallel=False)
    plan = evaluate(cfg.model, layout, cluster, 16, 1e9)
    tokens = 16 * cfg.model.seq_length
    with contextlib.redirect_stdout(io.StringIO()):
        logger = MetricsLogger(cfg, _single_state(cfg), peak_tflops=cluster.peak_tflops)
        record = logger.log_train(StepRecord(iteration=1, consumed_samples=16, loss=1.0,
                                             lr=1e-3, grad_norm=1.0, iter_time_s=plan.step_s,
                                             tokens=tokens, skipped=0))
    # N = 4 layers x (QKV 192·576 + out 192·192 + SwiGLU 3·192·512) + output 4096·192
    assert matmul_params(ModelShape.from_config(cfg.model)) == 2_555_904
    # the planner's headline counts attention causal (the log's mfu_causal), its non-causal
    # figure is the log's mfu
    assert plan.flops_per_token == logger.flops_per_token_causal == (6 * 2_555_904
                                                                     + 6 * 4 * 192 * 128)
    assert logger.flops_per_token == 6 * 2_555_904 + 12 * 4 * 192 * 128
    assert record["tokens_per_sec"] == plan.tokens_per_s
    assert record["mfu"] == pytest.approx(plan.mfu_noncausal, rel=1e-12)
    causal = record["mfu"] * logger.flops_per_token_causal / logger.flops_per_token
    assert causal == pytest.approx(plan.mfu, rel=1e-12)  # the log's mfu_causal


class _FakeRun:
    def __init__(self, log: list, run_dir: Path) -> None:
        self.calls, self.dir = log, str(run_dir / "files")

    def define_metric(self, name: str, **kw) -> None:
        self.calls.append(("define_metric", name, kw))

    def log(self, values: dict, step: int) -> None:
        self.calls.append(("log", step, values))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_wandb_adapter_with_a_fake_module(monkeypatch, tmp_path) -> None:
    """What reaches wandb: config at init, offline without a key (and the sync command),
    train metrics with the iteration as step, eval, checkpoint times, finish."""
    calls: list = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls, tmp_path / "run-x")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_config([*FLAGS, "--train-iters", "10", "--wandb-project", "p",
                        "--wandb-exp-name", "e"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logger = MetricsLogger(cfg, _single_state(cfg), peak_tflops=2.0)
        logger.log_train(StepRecord(iteration=5, consumed_samples=20, loss=3.0, lr=1e-3,
                                    grad_norm=0.5, iter_time_s=0.1, tokens=64, skipped=1,
                                    compute_time_s=0.08))
        logger.log_eval(5, 2.0)
        logger.log_checkpoint(5, seconds=2.0, gbytes=1.0)
        logger.log_event({"event": "nan_skip", "iteration": 6, "time": 1.5e9, "found": "r1"})
        logger.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["mode"]) == ("p", "e", "offline")
    assert init["config"]["model"]["num_query_groups"] == 2
    assert init["config"]["derived"]["flops_per_token"] == logger.flops_per_token
    logs = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logs] == [5, 5, 5, 6]
    assert logs[3][2] == {"events/nan_skip": 1}  # strings stay in the JSONL and the log
    train_keys = set(logs[0][2])
    assert set(JSONL_TRAIN_KEYS) - {"iteration"} <= train_keys
    assert {"mfu_causal", "skipped_iterations", "memory/rss_gib", "rank_time/max_ms"} <= \
        train_keys
    assert logs[0][2]["tokens_per_sec"] == pytest.approx(640.0)
    assert logs[1][2] == {"eval_loss": 2.0, "eval_ppl": pytest.approx(7.389, rel=1e-3)}
    assert logs[2][2] == {"checkpoint/save_s": 2.0, "checkpoint/gbytes": 1.0,
                          "checkpoint/gbytes_per_s": 0.5}
    assert calls[-1] == ("finish",)
    assert f"wandb sync {tmp_path / 'run-x'}" in out.getvalue()


def read_wandb_records(path: Path) -> list:
    """Records of a `.wandb` file: a ":W&B" header then LevelDB-log framing (32 KiB blocks,
    7-byte chunk headers: crc32c, length, type FULL/FIRST/MIDDLE/LAST) around protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk ends a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _read_complete_run(path: Path, timeout: float = 60.0) -> list:
    """wandb-core may still be writing the file when `finish()` returns (seen under load):
    wait for the run's final "exit" record."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.2)


def test_wandb_offline_training_run_files(monkeypatch, tmp_path) -> None:
    """A real wandb (offline, no network) under a short training; the run file read back."""
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    cfg = parse_config([*FLAGS, "--train-iters", "6", "--log-interval", "2", "--eval-interval",
                        "3", "--peak-tflops", "1", "--wandb-project", "ml-test",
                        "--wandb-save-dir", str(tmp_path / "wb")])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg, _single_state(cfg))
    (run_file,) = (tmp_path / "wb").rglob("offline-run-*/run-*.wandb")
    assert f"wandb sync {run_file.parent}" in out.getvalue()
    records = _read_complete_run(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["num_layers"] == 2 and config["logging"]["log_interval"] == 2
    assert config["derived"]["world_size"] == 1
    history: dict[int, set[str]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            keys = {"/".join(i.nested_key) or i.key for i in r.history.item}
            history.setdefault(r.history.step.num, set()).update(keys)
    assert sorted(history) == [2, 3, 4, 6]
    for step in (2, 4, 6):
        assert {"loss", "lr", "grad_norm", "mfu", "tokens_per_sec", "consumed_samples",
                "skipped_iterations", "memory/max_rss_gib"} <= history[step]
    for step in (3, 6):
        assert {"eval_loss", "eval_ppl"} <= history[step]


def _train_with_a_sleeping_rank(pstate: ParallelState, flags: list[str]) -> str:
    """Rank 1's forward/backward takes 400 ms longer, like a throttled GPU (more than a
    loaded 2-core box's first-iteration noise, which reached 250 ms)."""
    from megatron_lite.pipeline import engine

    if pstate.rank == 1:
        real = engine.forward_backward

        def slow(*args, **kwargs):
            time.sleep(0.4)
            return real(*args, **kwargs)

        engine.forward_backward = slow
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(parse_config(flags), pstate)
    return out.getvalue()


def test_straggler_warning_names_the_sleeping_rank(tmp_path) -> None:
    flags = [*FLAGS, "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
             "--peak-tflops", "1", "--straggler-intervals", "3"]
    text = run_ranks(_train_with_a_sleeping_rank, 2, tmp_path, flags=flags)[0]
    lines = text.splitlines()
    warnings = [i for i, line in enumerate(lines) if line.startswith("warning: straggler")]
    assert len(warnings) == 1, text  # at the 3rd interval in a row, not before or after
    assert lines[warnings[0] - 1].startswith("iter      3/4"), text
    assert "rank 1 on host" in lines[warnings[0]]
    iters = [line for line in lines if line.startswith("iter ")]
    assert all("(slowest rank 1 on " in line for line in iters), iters


# ---------------------------------------------------------------- where the time went


def _jsonl_trains(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_slow_loader_shows_in_data_wait(monkeypatch, tmp_path) -> None:
    """An injected 200 ms loader delay at iterations 3-4 appears in their data_wait_ms and in
    no other's; every record carries the four fields."""
    from megatron_lite.reliability.faults import FAULT_ENV, SLOW_DATA_S

    monkeypatch.setenv(FAULT_ENV, "rank0:iter3-4:slow_data")
    jsonl = tmp_path / "m.jsonl"
    cfg = parse_config([*FLAGS, "--train-iters", "6", "--log-interval", "1", "--eval-iters",
                        "0", "--peak-tflops", "1", "--log-jsonl", str(jsonl)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        train(cfg, _single_state(cfg))
    trains = _jsonl_trains(jsonl)
    waits = {r["iteration"]: r["data_wait_ms"] for r in trains}
    print("data_wait_ms by iteration:", {i: round(w, 2) for i, w in waits.items()})
    for i, wait in waits.items():
        if i in (3, 4):
            assert SLOW_DATA_S * 1e3 <= wait < SLOW_DATA_S * 1e3 + 100
        else:
            assert wait < 100  # the first step builds its batch cold: tens of ms
    for r in trains:
        assert r["tokens_seen"] == r["iteration"] * 4 * 16
        assert r["epoch"] == r["consumed_samples"] / 2**40  # mock data: 2^40 samples a pass
        assert r["comm_wait_ms"] >= 0
    assert "data wait 2" in out.getvalue()  # the log line has it too (200-300 ms)


def _train_slow_rank1(pstate: ParallelState, flags: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        train(parse_config(flags), pstate)
    return out.getvalue()


def test_slow_loader_on_one_rank_is_comm_wait_on_the_other(monkeypatch, tmp_path) -> None:
    """Rank 1's loader is 200 ms late at iteration 3: the record's data_wait_ms (the largest over
    ranks) shows it, and so does comm_wait_ms, rank 0's wait for rank 1 at the first collective
    after the data (the global token count)."""
    from megatron_lite.reliability.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "rank1:iter3:slow_data")
    jsonl = tmp_path / "m.jsonl"
    flags = [*FLAGS, "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
             "--peak-tflops", "1", "--log-jsonl", str(jsonl)]
    run_ranks(_train_slow_rank1, 2, tmp_path, flags=flags)
    trains = {r["iteration"]: r for r in _jsonl_trains(jsonl)}
    print("data_wait_ms / comm_wait_ms:", {i: (round(r["data_wait_ms"], 1),
                                              round(r["comm_wait_ms"], 1))
                                          for i, r in trains.items()})
    assert trains[3]["data_wait_ms"] >= 200 and trains[3]["comm_wait_ms"] >= 150
    for i in (2, 4):  # iteration 1 also holds the cold start, so it is not a baseline
        assert trains[i]["data_wait_ms"] < 100 and trains[i]["comm_wait_ms"] < 150


def _posted_recv_wait(pstate: ParallelState) -> float:
    from megatron_lite.pipeline.p2p import StageComm
    from megatron_lite.pipeline.schedule import Recv, Send

    comm = StageComm(pstate, (2, 1, 4), torch.float32)
    if pstate.pp_rank == 0:
        comm.exchange([Recv("activation", 0, 0, peer=1)], {})
    else:
        time.sleep(0.2)  # the neighbour is still computing
        send = Send("activation", 0, 0, peer=0)
        comm.exchange([send], {send: torch.ones(2, 1, 4)})
    return comm.wait_clock.pop_seconds()


def test_blocking_pipeline_receive_is_counted(tmp_path) -> None:
    waited, _ = run_ranks(_posted_recv_wait, 2, tmp_path, pp=2)
    assert 0.15 <= waited < 2
