"""Step-time model of the planner: each piece of a training step timed from its size.

Pure arithmetic (megatron_lite imports: the config and the model's parameter list, for
`ModelShape`; torch only inside `measure_cpu`). `planner.evaluate` builds a step from
`microbatch_costs` and `collective_s`; scripts/plan.py --explain prints it.

- GEMMs: a roofline, max(FLOPs / (peak x efficiency), bytes / HBM bandwidth), with a shape-
  dependent efficiency `gemm_efficiency` = e_max · d / (d + d_half), d the smallest of m, n, k:
  a thin GEMM (a TP-split weight, a small head dim) does less work per byte and per tile.
  Two numbers per device (`Hardware`), fitted once (`A100_FIT`) or from a calibration file
  (`load_calibration`, written by bench/gpu_calibrate.py inside scripts/gpu_check.sh).
- Memory-bound work by its bytes over the achieved HBM bandwidth: norms, RoPE, SwiGLU / GeLU,
  residual adds, dropout, the unfused attention's softmax over a·s² values, cross-entropy, the
  embedding (the optimizer step's bytes are in `planner`). Backward streams twice the forward's
  bytes (it reads the saved input and the incoming gradient and writes the input gradient).
- A fixed cost per kernel (`op_us`): on a GPU launches are asynchronous, so a kernel takes at
  least that long; on a CPU (`host_bound`) every op's dispatch adds to its work, which is what
  dominates tiny models.
- Collectives: latency + bytes over the bus bandwidth with the ring factor (2(n-1)/n
  all-reduce, (n-1)/n all-gather and reduce-scatter); `planner` picks NVLink or the network and
  decides what overlaps what.
- Attention: "flash" (our model: the causal half skipped, the backward recomputes the scores:
  5 matmuls against the forward's 2, Dao 2023; on the GEMM curve, or at the kernel's measured
  `Hardware.attention_tflops` where one is known: the CPU, a calibration file) or "unfused"
  (GPT as Megatron ran it in 2021: full s x s score and context batched GEMMs,
  scale-mask-softmax and dropout over them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from megatron_lite import structure
from megatron_lite.config import ModelConfig, MoEConfig, moe_layer_pattern
from megatron_lite.devices import by_name
from megatron_lite.errors import UserError

# ---------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class Hardware:
    """One device and its links, as the time model uses them."""

    peak_tflops: float
    """Dense peak in the training dtype (bf16/fp16 on GPUs; the measured matmul on a CPU)."""
    gemm_efficiency: float
    """e_max: the fraction of peak the largest GEMMs reach inside a training step."""
    gemm_half_dim: float
    """d_half: the smallest GEMM dimension at which efficiency is half of e_max."""
    hbm_gbps: float
    """Achieved bandwidth of streaming (memory-bound) kernels, GB/s."""
    intra_node_gbps: float
    """Achieved collective bus bandwidth per GPU inside a node (NVLink), GB/s."""
    inter_node_gbps: float
    """Achieved bus bandwidth per GPU across nodes, GB/s."""
    latency_us: float
    """Fixed cost per collective or p2p transfer."""
    op_us: float
    """Fixed cost per kernel: the launch interval on a GPU, dispatch on a CPU."""
    gpu_memory_gib: float
    attention_tflops: float = 0.0
    """Measured rate of the attention kernel (forward + backward, counted as `flash_core`
    counts it); 0: priced on the GEMM curve. A CPU's flash kernel runs far below its matmul
    rate (its softmax is scalar exp work over every score of a tile), so `measure_cpu` times it."""
    host_bound: bool = False
    """Kernels run on the host thread one after another (CPU): their fixed cost adds up."""


A100_FIT = {"gemm_efficiency": 0.69, "gemm_half_dim": 40.0}
"""e_max, d_half fitted once (grid search, the largest |residual| made smallest) on the HFU of
the ten GPT rows (1.7B-1T) of Narayanan et al. 2021 (SC21) Table 1 / Megatron-LM's README of
April 2021 (DGX A100 80 GB, seq 2048, fp16, full recompute), every other constant fixed
beforehand; tests/test_plan_time.py replays the rows and lists the residual of each. The rows
barely constrain d_half (their smallest GEMM dimension is >= 96): 0-40 fit equally well."""

H100_FIT = {"gemm_efficiency": 0.52, "gemm_half_dim": A100_FIT["gemm_half_dim"]}
"""e_max fitted once by least squares on the MFU of the nine GPT rows (1.7B-462B) of
Megatron-LM's H100 table (README@d98e8a6, images/model_table.png: seq 4096, vocab 131,072,
bf16, DP/TP overlap), d_half taken from `A100_FIT`; residuals in tests/test_plan_time.py.
H200 reuses it (the same GH100 compute). gpu_check's calibration file replaces both."""

_A100, _H100, _H200 = (by_name(name) for name in ("A100", "H100 SXM", "H200"))
PRESETS: dict[str, Hardware] = {
    # 312 TF fp16/bf16 dense; HBM2e 2,039 GB/s, ~91% achieved by streaming kernels; NVLink3
    # 300 GB/s per direction, NCCL all-reduce bus bandwidth ~230 GB/s on DGX A100;
    # 8 x 200 Gb/s HDR per node = 25 GB/s per GPU, ~80% achieved.
    "a100-80gb": Hardware(_A100.bf16, **A100_FIT, hbm_gbps=1850.0, intra_node_gbps=230.0,
                          inter_node_gbps=20.0, latency_us=20.0, op_us=4.0,
                          gpu_memory_gib=_A100.memory_gib),
    # 989 TF bf16 dense; HBM3 3.35 TB/s, ~80%; NVLink4 450 GB/s per direction, ~360 achieved;
    # 400 Gb/s NDR per GPU = 50 GB/s, ~80%.
    "h100-sxm": Hardware(_H100.bf16, **H100_FIT, hbm_gbps=2700.0, intra_node_gbps=360.0,
                         inter_node_gbps=40.0, latency_us=20.0, op_us=4.0,
                         gpu_memory_gib=_H100.memory_gib),
    # the H100 SXM's GH100 compute and links; HBM3e 4.8 TB/s, 141 GB
    "h200": Hardware(_H200.bf16, **H100_FIT, hbm_gbps=3900.0, intra_node_gbps=360.0,
                     inter_node_gbps=40.0, latency_us=20.0, op_us=4.0,
                     gpu_memory_gib=_H200.memory_gib),
    # ANCHORS.md §7 (2-core Xeon, fp32): ~0.25 TFLOP/s, until `measure_cpu` measures this one
    "cpu": Hardware(0.25, 1.0, 0.0, hbm_gbps=10.0, intra_node_gbps=5.0, inter_node_gbps=5.0,
                    latency_us=50.0, op_us=8.0, gpu_memory_gib=16.0, host_bound=True),
}
"""--hardware presets: peaks and memory from megatron_lite/devices.py's datasheets, achieved
bandwidths as said."""

CPU_GEMM_HALF_DIM = 0.0
"""d_half of fp32 torch.mm on the 2-core Xeon here: none. GEMMs of 2048 x d x d, d = 16 to
1024, one thread, on the shared machine (bench/plan_cpu.py --gemm-curve, twice): 57-85
GFLOP/s at d <= 128, 27-36 at d >= 256 (cache-resident small GEMMs are not slower), so the
CPU curve is flat at the rate `measure_cpu` measures at 2048 x 256 x 256, near the CPU
models' shapes (d = 128-576)."""


CPU_ATTENTION_TOKENS = 2048
"""Tokens of the batch `measure_cpu` times attention on (the matmul's 2048 rows): b = 2048 / s
sequences of at most 2048 tokens, so the timing stays under a second at any --seq-length."""


def measure_cpu(dtype_bytes: int = 4, seconds: float = 0.3,
                attention: tuple[int, int, int, int] | None = None) -> dict[str, float]:
    """This CPU's `Hardware` numbers, measured (medians: a shared CPU's best case would flatter
    it): the matmul rate at 2048 x 256 x 256 in the run's dtype (the peak, e_max = 1 on a
    flat curve), copy bandwidth, one autograd-recorded small op (dispatch), and, given the
    model's `attention` = (seq, heads, query groups, head dim), its causal SDPA forward +
    backward in fp32 (the model runs the CPU core in fp32 in every dtype) at
    `CPU_ATTENTION_TOKENS` tokens: the rate of `flash_core`'s FLOPs."""
    import time

    import torch

    dtype = torch.float32 if dtype_bytes == 4 else torch.bfloat16

    def median_s(fn) -> float:
        fn()
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 5:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    m, d = 2048, 256
    a, b = torch.randn(m, d, dtype=dtype), torch.randn(d, d, dtype=dtype)
    peak = 2 * m * d * d / median_s(lambda: a @ b)
    big = torch.randn(2**25 // dtype_bytes, dtype=dtype)
    out = torch.empty_like(big)
    gbps = 2 * big.numel() * dtype_bytes / median_s(lambda: out.copy_(big)) / 1e9
    small = torch.randn(8, 8, requires_grad=True)
    op_s = median_s(lambda: [small * 2 for _ in range(100)]) / 100
    out = {"peak_tflops": peak / 1e12, "gemm_efficiency": 1.0,
           "gemm_half_dim": CPU_GEMM_HALF_DIM, "hbm_gbps": gbps, "op_us": op_s * 1e6}
    if attention is not None:
        seq, heads, groups, d = attention
        seq = min(seq, CPU_ATTENTION_TOKENS)
        batch = CPU_ATTENTION_TOKENS // seq
        q, k, v = (torch.randn(batch, n, seq, d, requires_grad=True)
                   for n in (heads, groups, groups))
        grad = torch.randn(batch, heads, seq, d)

        def core() -> None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=groups != heads)
            torch.autograd.grad(o, (q, k, v), grad)

        out["attention_tflops"] = flash_core(batch * seq, seq, heads, d).flops_per_step \
            / median_s(core) / 1e12
    return out


def cpu_hardware(shape: ModelShape, seq_length: int, dtype_bytes: int = 4) -> Hardware:
    """The "cpu" preset with this machine's numbers measured now, attention at `shape`'s
    heads and `seq_length` (what scripts/plan.py --hardware cpu and bench/plan_cpu.py use)."""
    return replace(PRESETS["cpu"], **measure_cpu(dtype_bytes, attention=(
        seq_length, shape.heads, shape.query_groups, shape.head_dim)))


def hardware_fields() -> list[str]:
    """The `Hardware` fields a flag may override."""
    return [f.name for f in fields(Hardware) if f.name != "host_bound"]


def fit_gemm_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(e_max, d_half) fitting e ≈ e_max · d / (d + d_half) to (smallest dim, efficiency)
    points: d_half over a log grid, e_max by least squares for each."""
    best = (math.inf, 1.0, 1.0)
    for i in range(241):
        half = 10 ** (i / 60)  # 1 .. 10^4
        g = [d / (d + half) for d, _ in points]
        e_max = sum(gi * e for gi, (_, e) in zip(g, points)) / sum(gi * gi for gi in g)
        err = sum((e_max * gi - e) ** 2 for gi, (_, e) in zip(g, points))
        best = min(best, (err, e_max, half))
    return best[1], best[2]


def load_calibration(path: str | Path, hw: Hardware) -> Hardware:
    """`hw` with what bench/gpu_calibrate.py measured (`--calibration FILE`): the GEMM curve
    fitted to its GEMMs, its peak, streaming bandwidth, kernel cost and attention kernel's
    rate (files without one keep the preset's), and the bus bandwidth of its largest
    all-reduce inside the node."""
    try:
        data = json.loads(Path(path).read_text())
        peak = float(data["peak_tflops"])
        points = [(min(g["m"], g["n"], g["k"]), g["tflops"] / peak) for g in data["gemms"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--calibration {path}: cannot read it ({err}); write one with "
                        "bash scripts/gpu_check.sh (part calibrate)") from err
    if len(points) < 2:
        raise UserError(f"--calibration {path}: needs at least 2 GEMM timings, has "
                        f"{len(points)}")
    e_max, half = fit_gemm_curve(points)
    out = replace(hw, peak_tflops=peak, gemm_efficiency=e_max, gemm_half_dim=half)
    for key in ("hbm_gbps", "op_us", "attention_tflops"):
        if data.get(key):
            out = replace(out, **{key: float(data[key])})
    reduces = [c for c in data.get("collectives", []) if c["op"] == "all_reduce"]
    if reduces:
        out = replace(out, intra_node_gbps=max(reduces, key=lambda c: c["bytes"])["busbw_gbps"])
    return out


# ---------------------------------------------------------------------------------------------
# Pieces


def gemm_efficiency(m: float, n: float, k: float, hw: Hardware) -> float:
    """Fraction of peak an (m x k) @ (k x n) GEMM reaches: e_max · d / (d + d_half)."""
    d = min(m, n, k)
    return hw.gemm_efficiency * d / (d + hw.gemm_half_dim)


def gemm_s(m: float, n: float, k: float, hw: Hardware, e: int = 2, batch: float = 1.0,
           on_chip: bool = False) -> float:
    """Seconds of `batch` GEMMs of (m, n, k): the roofline of their FLOPs and bytes
    (`on_chip`: a fused kernel's operands never reach HBM, only its FLOPs count)."""
    flops = 2 * m * n * k * batch
    moved = 0.0 if on_chip else e * (m * k + k * n + m * n) * batch
    return max(flops / (hw.peak_tflops * 1e12 * gemm_efficiency(m, n, k, hw)),
               moved / (hw.hbm_gbps * 1e9))


def collective_s(nbytes: float, ranks: int, gbps: float, latency_us: float, kind: str) -> float:
    """One collective over `ranks` (`nbytes` = the full tensor): all-reduce moves 2(n-1)/n
    of it, all-gather and reduce-scatter (n-1)/n, a p2p send all of it once, an all-to-all
    the (n-1)/n of a rank's send buffer (`nbytes`) bound for the others."""
    if ranks == 1 and kind != "p2p":
        return 0.0
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
              "reduce_scatter": (ranks - 1) / ranks, "p2p": 1.0,
              "all_to_all": (ranks - 1) / ranks}[kind]
    return factor * nbytes / (gbps * 1e9) + latency_us * 1e-6


@dataclass(frozen=True)
class Costs:
    """Seconds of some work on one rank, by kind (what --explain prints), and its FLOPs."""

    gemm: float = 0.0
    memory: float = 0.0
    """Memory-bound kernels: bytes over HBM bandwidth."""
    overhead: float = 0.0
    """What the fixed cost per kernel adds."""
    flops: float = 0.0
    """FLOPs executed: recomputation and flash attention's extra backward matmuls included."""

    def __add__(self, other: Costs) -> Costs:
        return Costs(self.gemm + other.gemm, self.memory + other.memory,
                     self.overhead + other.overhead, self.flops + other.flops)

    def scale(self, x: float) -> Costs:
        return Costs(self.gemm * x, self.memory * x, self.overhead * x, self.flops * x)

    @property
    def total(self) -> float:
        return self.gemm + self.memory + self.overhead


@dataclass(frozen=True)
class Pass:
    """A forward pass of some work, and how much more its backward does."""

    gemms: tuple[tuple[float, float, float, float], ...]
    """(m, n, k, batch) of each GEMM."""
    streamed: float
    """Bytes of its memory-bound kernels."""
    kernels: int
    """Memory-bound kernels (the GEMMs are one kernel each)."""
    backward_flops: float = 2.0
    """Backward / forward GEMM work: 2 (input and weight gradients); 2.5 for flash."""
    backward_bytes: float = 2.0
    on_chip: bool = False
    """Flash attention: the score tiles stay on-chip (its HBM traffic is `streamed`)."""
    backward_kernels: int | None = None
    """Memory-bound kernels of the backward (default twice the forward's)."""
    tflops: float = 0.0
    """A measured rate of these GEMMs (`Hardware.attention_tflops`): replaces the roofline."""

    @property
    def flops_per_step(self) -> float:
        """FLOPs of the forward and the backward together."""
        return sum(2 * m * n * k * b for m, n, k, b in self.gemms) * (1 + self.backward_flops)

    def costs(self, hw: Hardware, e: int, backward: bool = False) -> Costs:
        """The forward, or (`backward`) the backward, as `Costs`."""
        fg, fb = (self.backward_flops, self.backward_bytes) if backward else (1.0, 1.0)
        flops = sum(2 * m * n * k * b for m, n, k, b in self.gemms) * fg
        times = ([2 * m * n * k * b * fg / (self.tflops * 1e12) for m, n, k, b in self.gemms]
                 if self.tflops else
                 [gemm_s(m, n, k, hw, e, b, self.on_chip) * fg for m, n, k, b in self.gemms])
        gemm_kernels = len(self.gemms) * (2 if backward else 1)
        kernels = self.kernels
        if backward:
            kernels = 2 * kernels if self.backward_kernels is None else self.backward_kernels
        memory = self.streamed * fb / (hw.hbm_gbps * 1e9)
        fixed = hw.op_us * 1e-6
        if hw.host_bound:  # every op's dispatch adds to its work
            overhead = (gemm_kernels + kernels) * fixed
        else:  # asynchronous launches: a kernel lasts at least the launch interval
            overhead = (sum(max(0.0, fixed * gemm_kernels / len(times) - t) for t in times)
                        if times else 0.0) + max(0.0, kernels * fixed - memory)
        return Costs(sum(times), memory, overhead, flops)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the FLOP count and the time model depend on: our decoder's
    (`from_config`, its matmul weights read from megatron_lite/structure.py), or a
    planning-only block's (planner.gpt_shape). planner re-exports it."""

    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int
    head_dim: int
    vocab: int
    gated_mlp: bool = True
    """SwiGLU has three h x f matrices (gate, up, down); a plain GELU MLP has two."""
    block: str = "llama"
    """llama: our decoder (RMSNorm, RoPE, SwiGLU, flash attention); gpt: GPT as Megatron-LM ran
    it in 2021 (LayerNorm, GeLU MLP, learned positions, unfused softmax attention with dropout),
    a planning-only shape (planner.gpt_shape) so published runs can be planned as they were
    run."""
    layer_matmul: int = 0
    """Matmul weights of one layer as megatron_lite/structure.py lists them; 0: counted from
    the dimensions (planner.matmul_params_per_layer), for the blocks we do not build."""
    moe_layers: int = 0
    """Layers whose MLP is a mixture of experts (--num-experts, --moe-layer-freq)..."""
    moe_active_ffn: int = 0
    """...and the SwiGLU width one token passes through there: top-k x --moe-ffn-hidden-size
    + the shared expert's (the active parameters, which the FLOPs count)..."""
    moe_experts: int = 0
    """...plus the router's E x h matmul."""

    @classmethod
    def from_config(cls, model: ModelConfig, tp_size: int = 1, moe: MoEConfig | None = None
                    ) -> ModelShape:
        """Our Llama decoder: SwiGLU, GQA, and the output layer over the vocabulary padded for
        `tp_size` (the logits it really computes); with `moe` its MoE layers' active width."""
        experts = moe.num_experts if moe is not None else None
        moe_layers = (sum(moe_layer_pattern(moe.moe_layer_freq, model.num_layers))
                      if experts else 0)
        active = ((moe.moe_ffn_hidden_size or model.ffn_hidden_size) * moe.moe_router_topk
                  + (moe.moe_shared_expert_intermediate_size or 0)) if experts else 0
        return cls(layers=model.num_layers, hidden=model.hidden_size,
                   ffn_hidden=model.ffn_hidden_size, heads=model.num_attention_heads,
                   query_groups=model.num_query_groups, head_dim=model.head_dim,
                   vocab=model.padded_vocab_size(tp_size),
                   layer_matmul=structure.matmul_weights(structure.layer_parameters(model, 0)),
                   moe_layers=moe_layers, moe_active_ffn=active, moe_experts=experts or 0)


def flash_core(tokens: float, seq: float, heads: float, head_dim: float) -> Pass:
    """Flash attention of `tokens` queries over `seq`-token sequences: q·kᵀ and p·v over the
    causal half of the s x s square (each query row sees on average s/2 keys), reading q, k,
    v and writing out (`streamed`, set by the caller); the backward reruns q·kᵀ and p·v, and
    computes dv, dp, dq, dk: 5 matmuls for the forward's 2."""
    return Pass(((tokens, seq / 2, head_dim, heads), (tokens, head_dim, seq / 2, heads)), 0.0, 1,
                backward_flops=2.5, on_chip=True)


GPU_KERNELS_PER_LAYER = {"llama": 8, "gpt": 10}
"""Memory-bound forward kernels of one layer with fused kernels: llama 2 RMSNorm, RoPE,
SwiGLU, 2 adds, 2 layout copies; gpt 2 LayerNorm, bias-GeLU, 2 bias-dropout-add, softmax,
dropout, 3 layout copies."""
CPU_KERNELS_PER_LAYER = (70, 98)
"""(forward, backward) aten ops of one layer outside its GEMMs and SDPA on the CPU reference
path (the Python RMSNorm, RoPE and SwiGLU references are several ops each, plus views and
copies), counted with a TorchDispatchMode: `python bench/plan_cpu.py --count-ops`."""


@dataclass(frozen=True)
class Work:
    """What one rank computes per micro-batch besides the shape."""

    tokens: int
    """Tokens of the micro-batch on this rank (b · s / cp)."""
    seq: int
    tp: int = 1
    sequence_parallel: bool = False
    e: int = 2
    """Bytes per activation element (2 bf16/fp16, 4 fp32)."""
    attention: str = "flash"
    cp: int = 1
    """Context-parallel size: each rank holds s/cp query rows of every sequence."""


def layer_passes(shape: ModelShape, w: Work, hw: Hardware) -> tuple[Pass, Pass]:
    """(one layer without its attention core, the attention core) on one TP rank."""
    e, tokens, tp = w.e, w.tokens, w.tp
    h, f, d = shape.hidden, shape.ffn_hidden // tp, shape.head_dim
    q, kv, heads = shape.heads * d // tp, shape.query_groups * d // tp, shape.heads // tp
    mlp_in = 2 * f if shape.gated_mlp else f
    gemms = ((tokens, q + 2 * kv, h, 1), (tokens, h, q, 1), (tokens, mlp_in, h, 1),
             (tokens, h, f, 1))
    t_sp = tokens / tp if w.sequence_parallel else tokens  # norms and adds on the SP shard
    if shape.block == "gpt":
        # 2 LayerNorms; bias + GeLU on f; 2 bias-dropout-adds (read 2, write 1, 1-byte mask);
        # learned-position blocks have biases on QKV and proj (in the GEMM epilogue: free)
        streamed = t_sp * (2 * 2 * e * h + 2 * (3 * e + 1) * h) + tokens * 2 * e * f
    else:
        # 2 RMSNorms; RoPE on q and k; SwiGLU reads 2f, writes f; 2 residual adds
        streamed = t_sp * (2 * 2 * e * h + 2 * 3 * e * h) + tokens * (2 * e * (q + kv)
                                                                      + 3 * e * f)
    if hw.host_bound:
        # the reference path's ops each read and write about one [tokens, h] activation
        fwd_ops, bwd_ops = CPU_KERNELS_PER_LAYER
        per_op = 2 * e * tokens * h
        body = Pass(gemms, max(streamed, fwd_ops * per_op), fwd_ops,
                    backward_kernels=bwd_ops,
                    backward_bytes=max(2.0, bwd_ops * per_op / max(streamed, fwd_ops * per_op)))
    else:
        body = Pass(gemms, streamed, GPU_KERNELS_PER_LAYER[shape.block])
    if w.attention == "flash":
        core = replace(flash_core(tokens, w.seq, heads, d),
                       streamed=e * tokens * (2 * q + 2 * kv), tflops=hw.attention_tflops)
        return body, core
    # unfused: per sequence and head, scores [s_local, s] = q·kᵀ and context = p·v over the
    # whole (masked) square; scale-mask-softmax reads and writes the scores, dropout reads,
    # writes and stores a 1-byte mask (9 B per score forward in fp16); backward: softmax
    # reads y and dy and writes dx, dropout reads dy and the mask and writes dx (11 B)
    seqs, local = tokens * w.cp / w.seq, w.seq / w.cp
    scores = tokens * w.seq * heads
    core = Pass(((local, w.seq, d, seqs * heads), (local, d, w.seq, seqs * heads)),
                scores * (4 * e + 1), 3, backward_bytes=(5 * e + 1) / (4 * e + 1))
    return body, core


def head_pass(shape: ModelShape, w: Work) -> Pass:
    """Final norm, output layer over V/t, and the vocab-parallel cross-entropy: forward reads
    the logits and writes their fp32 softmax, backward writes the logits' gradient."""
    vocab = shape.vocab / w.tp
    t_sp = w.tokens / w.tp if w.sequence_parallel else w.tokens
    logits = w.tokens * vocab
    return Pass(((w.tokens, vocab, shape.hidden, 1),),
                2 * w.e * t_sp * shape.hidden + logits * (w.e + 4), 6,
                backward_bytes=(4 + w.e) / (w.e + 4))


def embedding_pass(shape: ModelShape, w: Work) -> Pass:
    """The lookup (and, for GPT, the learned positions added); backward scatters into an
    fp32 gradient."""
    pos = 2 if shape.block == "gpt" else 1
    return Pass((), w.tokens * shape.hidden * w.e * (1 + pos), 1 + pos,
                backward_bytes=(w.e + 4) / (w.e * (1 + pos)))


def microbatch_costs(shape: ModelShape, w: Work, hw: Hardware, layers: int, rerun: int,
                     selective: bool, head: bool, embedding: bool) -> Costs:
    """One micro-batch's forward and backward through `layers` layers of one stage (plus the
    head / the embedding where the stage holds them), and what recomputation reruns: the whole
    forward of `rerun` layers (full), or every attention core's (`selective`)."""
    body, core = layer_passes(shape, w, hw)
    fwd = body.costs(hw, w.e) + core.costs(hw, w.e)
    layer = fwd + body.costs(hw, w.e, backward=True) + core.costs(hw, w.e, backward=True)
    total = layer.scale(layers) + fwd.scale(rerun)
    if selective:
        total = total + core.costs(hw, w.e).scale(layers)
    for on, piece in ((head, head_pass(shape, w)), (embedding, embedding_pass(shape, w))):
        if on:
            total = total + piece.costs(hw, w.e) + piece.costs(hw, w.e, backward=True)
    return total


def attention_s(shape: ModelShape, w: Work, hw: Hardware) -> float:
    """One layer's attention core, forward and backward: what the CP ring's transfers hide
    behind."""
    core = layer_passes(shape, w, hw)[1]
    return core.costs(hw, w.e).total + core.costs(hw, w.e, backward=True).total
