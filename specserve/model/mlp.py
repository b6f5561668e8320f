"""The decoder's MLP kinds: a gated dense MLP (SwiGLU, or GeGLU for Gemma) and a mixture of experts.

Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): a router scores the experts for each token, softmax
over all of them, keeps the top num_experts_per_tok (with norm_topk_prob renormalised to sum to 1: Mixtral's
"softmax over the chosen logits" is the same numbers); the token's output is the weighted sum of its experts'
gated MLPs, plus a shared expert's where the config has one. A step's (token, expert) pairs are sorted by
expert, so each chosen expert multiplies its matrices once, over all of its tokens, and an expert no token
chose is never read: a decode step's cost follows the experts it touches, not the model's size.

Two ways to run the experts, by how they are held:
- stacked tensors [E, rows, cols] (as loaded; GPUs, other dtypes): one grouped matmul per projection over
  the sorted rows (torch's F.grouped_mm: no host synchronisation, so it can run inside a CUDA graph), or a
  matmul per chosen expert where torch lacks it for the device and dtype;
- one KernelLinear pair per expert (CPU inference: `pack_experts` at load, quantized experts from
  quantize.py): the C kernel per chosen expert over its rows, gate/up interleaved so that it returns
  silu(gate) * up directly. Experts have no one-call path (cpu_forward.py): MoE layers run layer by layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.cpu_linear import KernelLinear, kernel_can_run


def gated(gate_up: nn.Module, h: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up [T, intermediate] from a fused [gate; up] projection of h."""
    if act == "silu" and isinstance(gate_up, KernelLinear):  # straight from the kernel, no [T, 2 I] in between
        return gate_up.swiglu(h)
    gate, up = gate_up(h).chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


class DenseMLP(nn.Module):
    """down(act(gate) * up): a MoE layer's shared expert."""

    def __init__(self, hidden: int, intermediate: int, act: str, device=None):
        super().__init__()
        self.act = act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj, h, self.act))


class MoE(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.act = experts, config.num_experts_per_tok, config.hidden_act
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Linear(hidden, experts, bias=False, device=device)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, device=device))  # [gate; up] rows
        self.down = nn.Parameter(torch.empty(experts, hidden, inter, device=device))
        # Per expert [gate_up, down] modules, where the kernel runs them (then gate_up/down are None).
        self.experts: nn.ModuleList | None = None
        shared = config.shared_expert_intermediate_size
        self.shared_expert = DenseMLP(hidden, shared, self.act, device) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, device=device) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k]) of each token's top k experts."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert, tokens in order inside
        rows = order // self.top_k
        xs = x.index_select(0, rows)
        if self.experts is not None:
            ys = self._per_expert(xs, torch.bincount(flat, minlength=self.num_experts).tolist())
        else:
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).index_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offsets = counts.cumsum(0, dtype=torch.int32)
            h = grouped_linear(xs, self.gate_up, offsets)
            gate, up = h.chunk(2, dim=-1)
            ys = grouped_linear((F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")) * up,
                                self.down, offsets)
        out = torch.zeros_like(x).index_add_(0, rows, ys * weights.flatten()[order, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _per_expert(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ys, start = torch.empty_like(xs), 0
        for expert, n in enumerate(counts):
            if n:
                gate_up, down = self.experts[expert]
                ys[start:start + n] = down(gated(gate_up, xs[start:start + n], self.act))
                start += n
        return ys

    def runs_in_cuda_graphs(self, dtype: torch.dtype) -> bool:
        """Whether the experts run without reading the routing on the host (a CUDA graph cannot)."""
        return hasattr(F, "grouped_mm") and dtype == torch.bfloat16 and self.experts is None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (group e ends at row offsets[e]) times their expert's weight [E, out, in]^T."""
    on_device = x.device.type == "cpu" or x.dtype == torch.bfloat16  # F.grouped_mm's CUDA kernels take bf16
    if hasattr(F, "grouped_mm") and on_device and not (torch.is_grad_enabled() and weight.requires_grad):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out, start = x.new_empty(x.shape[0], weight.shape[1]), 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
        start = end
    return out


def pack_experts(moe: MoE) -> bool:
    """Move a MoE's float experts onto the kernel (one KernelLinear pair each, gate/up interleaved) where it
    runs; the stacked tensors are dropped. Returns whether it did."""
    if moe.experts is not None or not kernel_can_run(moe.gate_up):
        return False
    set_experts(moe, [(KernelLinear.from_weight(moe.gate_up[e].detach(), interleave=True),
                       KernelLinear.from_weight(moe.down[e].detach())) for e in range(moe.num_experts)])
    return True


def set_experts(moe: MoE, experts: list[tuple[nn.Module, nn.Module]]) -> None:
    """Run `moe` on these per-expert (gate_up, down) modules from now on, in place of its stacked tensors."""
    moe.experts = nn.ModuleList(nn.ModuleList(pair) for pair in experts)
    moe.gate_up = moe.down = None
