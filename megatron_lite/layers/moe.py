"""Mixture-of-experts MLP: a router, E SwiGLU experts run as grouped GEMMs, a shared expert.

Dispatch (no expert parallelism yet, every rank holds all E experts, each split over TP like
the dense MLP): the (token, expert) pairs of the routing map are listed sorted by expert
(`nonzero` of the transposed map: a permutation, no loop over experts), the tokens gathered
in that order, and each projection is one `torch._grouped_mm` over the per-expert row blocks
(`offs` = cumulative counts). The down projection's rows are scaled by their router weights
and summed back into their tokens with `index_add` (unpermute). Dropless by default; with a
capacity the router's map already holds only the kept pairs.

`torch._grouped_mm` takes bf16/fp32 rows whose widths are multiples of 16 bytes (and only
bf16 on CUDA); float64 (--fp64) and other shapes use `padded_bmm`, the same math: the rows
scattered into an [E, max rows, k] zero-padded batch and one `bmm`. tests/layers/test_moe.py
checks both against a per-token loop. Under --fp8-format (outside the --first-last-layers-bf16
layers) each projection is `Fp8GroupedLinear` instead: e4m3 operands, rowwise current scaling
(layers/fp8.py), whatever the dtype and widths.

Under expert TP (--expert-tensor-parallel-size e, by default the TP size t) each rank holds
gate/up rows [E x 2f/e, h] (each expert's gate and up split like the dense column layer) and
down [E x h, f/e] (each expert's input columns split), so the experts' output is a partial
sum: under SP the router runs on this rank's sequence slice, then tokens, weights and map
are all-gathered over the expert-TP group (e consecutive TP ranks) and the output
reduce-scattered back (Megatron's allgather dispatcher); without SP (e = t) every rank routes
all tokens and the output is all-reduced. At e = 1 nothing is gathered: each TP rank's own
tokens reach whole experts, over EP when the EP group takes TP ranks (parallel folding).

Every size a layer's dispatch needs comes from ONE device->host read per micro-batch
(`host_counts`, counted as `MOE_SYNC_KIND`): the per-expert counts (under the alltoall
dispatcher stacked with the counts received from the EP ranks, exchanged once); the number
of pairs (`nonzero_static` of that size, no sync of its own), the all-to-all splits, the
padded batch's width and every `repeat_interleave` size are derived from it on the host.

On the meta device (the rank dry run) no routing decision has a value, so that one read
takes a stand-in: `router.stand_in_counts`, a seeded skewed draw per (layer, source EP rank)
with an empty expert and counts that are not multiples of 16, the same on every rank, so the
grouped GEMMs' and `_scaled_grouped_mm`'s layout rules meet uneven loads and the ranks'
exchanged sizes agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from megatron_lite.config import ModelConfig, MoEConfig, moe_layer_pattern
from megatron_lite.kernels.swiglu import swiglu
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.fp8 import Fp8GroupedLinear, Fp8Recipe
from megatron_lite.layers.init import init_shard
from megatron_lite.layers.mlp import SwiGLUMLP
from megatron_lite.layers.router import Router, stand_in_counts
from megatron_lite.parallel import comms, host_syncs
from megatron_lite.parallel.host_syncs import MOE_SYNC_KIND
from megatron_lite.parallel.state import ParallelState


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: `_grouped_mm`'s backward fails
    on an expanded one (stride 0, e.g. from `.sum().backward()`)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_mm_fits(x: Tensor, w: Tensor) -> bool:
    """`torch._grouped_mm` takes these operands: bf16 (or fp32 on the CPU), every width a
    multiple of 16 bytes."""
    ok_dtype = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.device.type == "cpu")
    align = 16 // x.element_size()
    return ok_dtype and x.size(1) % align == 0 and w.size(2) % align == 0


STAND_IN_SEED = 1_000_003
"""The meta stand-in's draw for (layer, source EP rank) is seeded layer x this + source."""


def host_counts(counts: Tensor, stand_in: Callable[[], Sequence]) -> list:
    """`counts` on the host: the MoE layer's one device->host sync per micro-batch. On meta
    (no values) the `stand_in` draw, the read still counted as what a GPU pays."""
    if counts.is_meta:
        host_syncs.note_meta_syncs(counts.device, 1, MOE_SYNC_KIND)
        return list(stand_in())
    return counts.tolist()


def padded_bmm(x: Tensor, w: Tensor, counts: Tensor, sizes: Sequence[int] | None = None
               ) -> Tensor:
    """Rows of `x` [N, k] sorted by group, group g's `counts[g]` rows times w[g] [k, n], as one
    zero-padded batched matmul (each output row depends only on its own input row).
    `sizes`: the counts on the host (`host_counts`); without them the width is read (a sync)."""
    groups = w.size(0)
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts,
                                    output_size=x.size(0))
    slot = torch.arange(x.size(0), device=x.device) - (counts.cumsum(0) - counts)[group]
    if sizes is not None:
        width = max(sizes, default=0)
    else:
        width = int(counts.max()) if x.size(0) else 0
    batch = x.new_zeros(groups, width, x.size(1)).index_put((group, slot), x)
    return torch.bmm(batch, w)[group, slot]


def grouped_matmul(x: Tensor, w: Tensor, counts: Tensor, sizes: Sequence[int] | None = None
                   ) -> Tensor:
    """x [N, k] (rows sorted by group) @ w [G, k, n] per group of `counts` rows -> [N, n]
    (`sizes`: the counts on the host, for `padded_bmm`)."""
    if not grouped_mm_fits(x, w):
        return padded_bmm(x, w, counts, sizes)
    offs = counts.cumsum(0).to(torch.int32)
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))


def expert_matmul(x: Tensor, w: Tensor, counts: Tensor, fp8: Fp8Recipe | None = None,
                  k_group: comms.Group = None, n_group: comms.Group = None,
                  sizes: Sequence[int] | None = None) -> Tensor:
    """`grouped_matmul`, or under --fp8-format its e4m3 rowwise-scaled form (layers/fp8.py;
    `k_group` / `n_group`: the TP group the contraction / output dim is sharded over)."""
    if fp8 is None:
        return grouped_matmul(x, w, counts, sizes)
    return Fp8GroupedLinear.apply(x, w, counts, fp8.margin, k_group, n_group)


def swiglu_experts(rows: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor,
                   use_triton: bool = False, fp8: Fp8Recipe | None = None,
                   tp_group: comms.Group = None, sizes: Sequence[int] | None = None
                   ) -> Tensor:
    """SwiGLU_e of each row (rows sorted by expert, `counts` per expert, `sizes` the same on
    the host): gate/up's output and down's input are the TP-sharded dims."""
    hidden = expert_matmul(rows, gate_up, counts, fp8, n_group=tp_group, sizes=sizes)
    gate, up = hidden.chunk(2, dim=-1)
    return expert_matmul(swiglu(gate, up, use_triton=use_triton), down, counts, fp8,
                         k_group=tp_group, sizes=sizes)


def routed_pairs(routing_map: Tensor, pairs: int | None = None) -> tuple[Tensor, Tensor]:
    """(expert ids, token ids) of the map's (token, expert) pairs, sorted by expert. With the
    number of `pairs` known on the host, `nonzero_static` (no sync); without, `nonzero` (one)."""
    if pairs is None:
        return routing_map.t().nonzero(as_tuple=True)
    expert_ids, token_ids = torch.nonzero_static(routing_map.t(), size=pairs).unbind(1)
    return expert_ids, token_ids


def experts_forward(x: Tensor, probs: Tensor, routing_map: Tensor, gate_up: Tensor,
                    down: Tensor, stand_in: Callable[[], Sequence[int]], use_triton: bool = False,
                    fp8: Fp8Recipe | None = None, tp_group: comms.Group = None) -> Tensor:
    """sum over each token's routed experts e of probs[t, e] x SwiGLU_e(x[t]).

    x [N, h]; probs, routing_map [N, E]; gate_up [E, h, 2f] (gate columns first), down
    [E, f, h]. Returns [N, h] (a partial sum over TP when the weights are TP shards).
    `stand_in`: the map's per-expert counts on meta (`host_counts`); `fp8`: the GEMMs in FP8,
    `tp_group` the group the weights are sharded over."""
    counts = routing_map.sum(0)
    sizes = host_counts(counts, stand_in)  # the one host read
    expert_ids, token_ids = routed_pairs(routing_map, sum(sizes))  # sorted by expert
    out = swiglu_experts(x[token_ids], gate_up, down, counts, use_triton, fp8, tp_group,
                         sizes)
    out = out * probs[token_ids, expert_ids].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token_ids, out)


class MoE(nn.Module):
    """Router + E routed SwiGLU experts (+ a shared expert), in place of the dense MLP."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, ctx: LayerContext, layer: int) -> None:
        super().__init__()
        ctx = replace(ctx, weight_grads=None)  # expert weights get plain-autograd gradients
        experts, hidden, t = moe.num_experts, cfg.hidden_size, ctx.etp_size
        ffn = moe.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.experts, self.local_ffn, self.layer = experts, ffn // t, layer
        # tokens gathered, outputs reduced and expert weights split over expert TP
        self.etp_group, self.sequence_parallel = ctx.etp_group, ctx.sequence_parallel
        self.use_triton, self.topk = ctx.use_triton, moe.moe_router_topk
        self.fp8 = ctx.fp8  # None in the --first-last-layers-bf16 layers (ctx.for_layer)
        self.router = Router(hidden, moe, ctx, std=cfg.init_method_std,
                             name=f"layers.{layer}.mlp.router")
        ep = ctx.ep_size
        self.local_experts, self.first_expert = experts // ep, ctx.ep_rank * (experts // ep)
        self.ep_rank = ctx.ep_rank
        self.ep_group, self.dispatcher = ctx.ep_group, moe.moe_token_dispatcher_type
        self.gate_up, self.down = self._expert_weights(cfg, ffn, ctx)
        width = moe.moe_shared_expert_intermediate_size
        self.shared = (SwiGLUMLP(cfg, ctx, width, f"layers.{layer}.mlp.shared") if width
                       else None)
        self.overlap_shared = moe.moe_shared_expert_overlap
        self.shared_gate = None
        if moe.moe_shared_expert_gate:  # [1, h], whole on every TP rank, like the router
            self.shared_gate = tags.mark_replicated(nn.Parameter(init_shard(
                (1, hidden), None, std=cfg.init_method_std, seed=ctx.seed, tp_size=1,
                tp_rank=0, name=f"layers.{layer}.mlp.shared_gate", device=ctx.device,
                dtype=ctx.dtype)))
            if ctx.sequence_parallel:  # each TP rank's tokens: a partial gradient
                tags.mark_sequence_parallel_grad(self.shared_gate)

    def _expert_weights(self, cfg: ModelConfig, ffn: int, ctx: LayerContext
                        ) -> tuple[nn.Parameter, nn.Parameter]:
        """This rank's experts, stacked: gate/up [E_local x 2f/e, h] (each expert's gate and
        up column-split over expert TP) and down [E_local x h, f/e] (row-split). Each expert is
        drawn on its own name, so every EP and TP size starts from the same experts."""
        hidden, layer = cfg.hidden_size, self.layer
        shard = dict(tp_size=ctx.etp_size, tp_rank=ctx.etp_rank, device=ctx.device,
                     dtype=ctx.dtype, seed=ctx.seed)
        down_std = cfg.init_method_std / math.sqrt(2 * cfg.num_layers)
        ids = range(self.first_expert, self.first_expert + self.local_experts)
        gate_up = torch.cat([init_shard((2 * ffn, hidden), tags.column_split([ffn, ffn]),
                                        std=cfg.init_method_std,
                                        name=f"layers.{layer}.mlp.experts.{e}.gate_up",
                                        **shard) for e in ids])
        down = torch.cat([init_shard((hidden, ffn), tags.row_split(), std=down_std,
                                     name=f"layers.{layer}.mlp.experts.{e}.down", **shard)
                          for e in ids])
        split = tags.column_split([ffn] * (2 * self.local_experts))
        return (tags.mark_expert(tags.mark_tp_split(nn.Parameter(gate_up), split)),
                tags.mark_expert(tags.mark_tp_split(nn.Parameter(down), tags.row_split())))

    def expert_weights(self) -> tuple[Tensor, Tensor]:
        """This rank's gate/up [E, h, 2f/t] and down [E, f/t, h] as matmul operands (views)."""
        e, f = self.local_experts, self.local_ffn
        gate_up = self.gate_up.view(e, 2 * f, -1).transpose(1, 2)
        down = self.down.view(e, -1, f).transpose(1, 2)
        return gate_up, down

    def forward(self, x: Tensor) -> Tensor:
        """x [s(/t), b, h] -> [s(/t), b, h]."""
        s, b, h = x.shape
        probs, routing_map = self.router(x.reshape(s * b, h), s)
        group = self.etp_group
        if self.sequence_parallel:
            tokens = comms.gather_from_sequence_region(x, group, kind="etp")
            probs = comms.gather_from_sequence_region(probs.view(s, b, -1), group, kind="etp")
            routing_map = comms.all_gather_dim0(
                routing_map.view(s, b, -1).to(torch.uint8).contiguous(), group,
                kind="etp")[0].bool()
        else:
            tokens = comms.copy_to_region(x, group, kind="etp")
            probs = comms.copy_to_region(probs, group, kind="etp")
        full = tokens.shape[0]
        during = (lambda: self._shared_output(x)) if self.overlap_shared else None
        out, shared = self._dispatch(tokens.reshape(full * b, h),
                                     probs.reshape(full * b, -1).to(x.dtype),
                                     routing_map.reshape(full * b, -1), during)
        out = out.view(full, b, h)
        out = (comms.reduce_scatter_to_sequence_region(out, group, kind="etp")
               if self.sequence_parallel else comms.reduce_from_region(out, group, kind="etp"))
        if self.shared is not None:
            out = out + (shared if shared is not None else self._shared_output(x))
        return out

    def _shared_output(self, x: Tensor) -> Tensor:
        """The shared expert on x, scaled by sigmoid(x . g) per token when gated."""
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = shared * torch.sigmoid(x @ self.shared_gate.t())
        return shared


    def _dispatch(self, tokens: Tensor, probs: Tensor, routing_map: Tensor,
                  during: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """The experts' summed output for every row of `tokens` [N, h] (a partial sum over TP),
        this rank's experts run here and the others' on their EP ranks; and what `during`
        (the shared expert under --moe-shared-expert-overlap) returned, computed while the
        alltoall dispatcher's tokens are on their way (run first without one)."""
        if self.dispatcher == "alltoall" and comms.group_size(self.ep_group) > 1:
            return self._all_to_all(tokens, probs, routing_map, during)
        extra = during() if during is not None else None
        if comms.group_size(self.ep_group) == 1:
            return experts_forward(tokens, probs, routing_map, *self.expert_weights(),
                                   lambda: self._stand_in(tokens.size(0), 0),
                                   use_triton=self.use_triton, fp8=self.fp8,
                                   tp_group=self.etp_group), extra
        return self._all_gather(tokens, probs, routing_map), extra

    def _stand_in(self, tokens: int, source: int) -> tuple[int, ...]:
        """The meta stand-in's per-expert counts of `tokens` tokens of EP rank `source`."""
        return stand_in_counts(tokens, self.router.moe, STAND_IN_SEED * self.layer + source)

    def _exchange_stand_in(self, tokens: int) -> list[list[list[int]]]:
        """On meta, what the alltoall dispatcher's one read returns: [this rank's counts per
        (destination, local expert), the counts received per (source, local expert)]."""
        ep, local, first = comms.group_size(self.ep_group), self.local_experts, self.first_expert
        draws = [self._stand_in(tokens, source) for source in range(ep)]
        sent = [list(draws[self.ep_rank][r * local:(r + 1) * local]) for r in range(ep)]
        return [sent, [list(draw[first:first + local]) for draw in draws]]

    def _local(self, x: Tensor) -> Tensor:
        """The columns of this rank's experts in a [N, E] table."""
        return x[:, self.first_expert:self.first_expert + self.local_experts]

    def _all_gather(self, tokens: Tensor, probs: Tensor, routing_map: Tensor) -> Tensor:
        """allgather dispatcher: every EP rank takes all the group's tokens, runs its own
        experts on the ones routed to them, and the partial outputs are reduce-scattered back
        (gradients: the reverse collectives)."""
        group = self.ep_group
        tokens = comms.gather_from_sequence_region(tokens, group, kind="ep")
        probs = comms.gather_from_sequence_region(probs, group, kind="ep")
        routing_map = comms.all_gather_dim0(routing_map.to(torch.uint8).contiguous(),
                                            group, kind="ep")[0].bool()
        first, local = self.first_expert, self.local_experts
        out = experts_forward(tokens, self._local(probs), self._local(routing_map),
                              *self.expert_weights(),
                              lambda: self._stand_in(tokens.size(0), 0)[first:first + local],
                              use_triton=self.use_triton, fp8=self.fp8,
                              tp_group=self.etp_group)
        return comms.reduce_scatter_to_sequence_region(out, group, kind="ep")

    def _all_to_all(self, tokens: Tensor, probs: Tensor, routing_map: Tensor,
                    during: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """alltoall dispatcher: each (token, expert) pair goes only to its expert's EP rank.

        Pairs sorted by global expert are already grouped by destination rank; the per-expert
        counts are exchanged first and read on the host with the counts received, in one
        sync (the splits are sizes), the rows arrive grouped by source rank and are sorted by
        local expert for the grouped GEMM, and the outputs go back the same way, weighted and
        summed into their tokens at home.
        """
        group, ep, local = self.ep_group, comms.group_size(self.ep_group), self.local_experts
        counts = routing_map.sum(0).view(ep, local)
        received = comms.all_to_all_counts(counts, group, kind="ep")  # [source rank, local expert]
        sent_h, recv_h = host_counts(torch.stack([counts, received]),
                                     lambda: self._exchange_stand_in(routing_map.size(0)))
        send, recv = [sum(row) for row in sent_h], [sum(row) for row in recv_h]
        expert_ids, token_ids = routed_pairs(routing_map, sum(send))
        extra = None
        if during is None:
            rows = comms.all_to_all_rows(tokens[token_ids], send, recv, group, kind="ep")
        else:  # the shared expert runs while the rows travel
            rows, pending = comms.start_all_to_all_rows(tokens[token_ids], send, recv, group,
                                                        kind="ep")
            extra = during()
            rows = pending.wait(rows)
        order = self._by_local_expert(received, rows)
        gate_up, down = self.expert_weights()
        out = swiglu_experts(rows[order], gate_up, down, received.sum(0), self.use_triton,
                             self.fp8, self.etp_group, [sum(c) for c in zip(*recv_h)])
        back = comms.all_to_all_rows(out[torch.argsort(order)], recv, send, group, kind="ep")
        back = back * probs[token_ids, expert_ids].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_ids, back), extra


    def _by_local_expert(self, received: Tensor, rows: Tensor) -> Tensor:
        """The order that sorts the received rows (grouped by source rank) by local expert."""
        ep, local = received.shape
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep), received.flatten(),
            output_size=rows.size(0))
        return torch.argsort(expert_of_row, stable=True)


class MoEStep:
    """The training step's MoE bookkeeping over all of this rank's MoE layers.

    `begin` sets the scale of the router losses' gradients to 1 / (micro-batches x DP), the
    scale Megatron gives them: each micro-batch's aux loss counts like its mean LM loss, whose
    gradients are summed over DP here. `end` sums every layer's routed-token counts and loss
    shares over all ranks (one all-reduce of a [layers, E + 2] table: PP stages fill their own
    layers' rows, TP ranks only under SP, where they route different tokens), reports
    metrics.MOE_TERMS, and moves the expert biases: bias += rate x sign(mean count - count), from
    the counts of the whole step (DeepSeek-V3's update, as Megatron makes it after the
    backward). Every rank keeps every layer's bias row (the routers hold views of theirs), so
    rank 0's `state_dict` is the whole model's and the checkpoint's metadata keeps it.
    """

    def __init__(self, moe: MoEConfig, num_layers: int, pstate: ParallelState,
                 chunks: Sequence[nn.Module]) -> None:
        self.moe, self.pstate = moe, pstate
        self.moe_layers = [i for i, on in enumerate(moe_layer_pattern(moe.moe_layer_freq,
                                                                      num_layers)) if on]
        self.routers = {m.layer: m.router for chunk in chunks for m in chunk.modules()
                        if isinstance(m, MoE)}
        self.counted = (any(r.splits_over_tp for r in self.routers.values())
                        or pstate.tp_rank == 0)
        self.table_rows, self.microbatches = num_layers, 1
        self.bias = None
        if moe.moe_router_enable_expert_bias:
            self.bias = torch.zeros(num_layers, moe.num_experts, dtype=torch.float32,
                                    device=pstate.device)
            for layer, router in self.routers.items():
                router.expert_bias = self.bias[layer]

    def begin(self, microbatches: int) -> None:
        """Before the step's forward-backward: fresh statistics, the loss-gradient scale."""
        self.microbatches = microbatches
        for router in self.routers.values():
            router.pop_stats()
            router.loss_scale = 1.0 / (microbatches * self.pstate.dp_size)

    def end(self, update_bias: bool) -> dict[str, float]:
        """After the optimizer step (`update_bias`: it updated the weights)."""
        experts = self.moe.num_experts
        table = torch.zeros(self.table_rows, experts + 2, dtype=torch.float64,
                            device=self.pstate.device)
        for layer, router in self.routers.items():
            stats = router.pop_stats()
            if self.counted:
                table[layer, :experts] = stats.tokens_per_expert
                table[layer, experts] = stats.aux_loss
                table[layer, experts + 1] = stats.z_loss
        rows = comms.all_reduce_(table, self.pstate.world_group, kind="world")[self.moe_layers]
        counts = rows[:, :experts]
        mean = counts.mean(-1, keepdim=True)
        if update_bias and self.bias is not None:
            step = torch.sign(mean - counts) * self.moe.moe_router_bias_update_rate
            self.bias[self.moe_layers] += step.to(self.bias.dtype)
        per_microbatch = self.microbatches * self.pstate.dp_size
        out = {"moe_load_imbalance": (counts.max(-1).values / mean[:, 0]).mean()}
        if self.moe.moe_aux_loss_coeff and self.moe.moe_router_load_balancing_type != "none":
            out["load_balancing_loss"] = rows[:, experts].mean() / per_microbatch
        if self.moe.moe_z_loss_coeff:
            out["z_loss"] = rows[:, experts + 1].mean() / per_microbatch
        return {name: comms.host_scalar(value) for name, value in out.items()}

    def state_dict(self) -> dict:
        return {} if self.bias is None else {"expert_bias": self.bias.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if self.bias is not None and "expert_bias" in state:
            self.bias.copy_(torch.tensor(state["expert_bias"], dtype=self.bias.dtype))
