"""Feed-forward blocks of the hybrid architectures: dense MLPs and mixtures of experts.

The SwiGLU MLP is the transformer family's `gated_mlp`; relu² (NemotronH) and the two MoE
routers (Granite: softmax over the top-k logits; NemotronH: sigmoid scores, grouped top-k,
a score-correction bias) follow transformers' modeling code, including its expert loop
order, so sums accumulate in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core.ops import linear, silu_and_mul
from heron.plugins.hybrid_ssm.config import MoeConfig
from heron.plugins.transformer.model import gated_mlp


@dataclass
class MlpWeights:
    up: torch.Tensor                 # gated: [2 I, hidden] (gate rows, then up); else [I, hidden]
    down: torch.Tensor               # [hidden, I]
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    is_gated: bool = True            # SwiGLU; False: relu²


@dataclass
class MoeWeights:
    router: torch.Tensor             # [E, hidden] (float32 for the sigmoid router)
    experts_up: torch.Tensor         # [E, 2 I or I, d]
    experts_down: torch.Tensor       # [E, d, I]
    shared: MlpWeights | None
    score_bias: torch.Tensor | None = None   # [E] float32 (sigmoid router)
    latent_in: torch.Tensor | None = None    # [latent, hidden]: experts run in a latent space
    latent_in_bias: torch.Tensor | None = None
    latent_out: torch.Tensor | None = None   # [hidden, latent]
    latent_out_bias: torch.Tensor | None = None
    is_gated: bool = True


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """``[T, hidden] -> [T, hidden]``."""
    if w.is_gated:
        return gated_mlp(h, w.up, w.down, w.up_bias, w.down_bias)
    return linear(relu2(linear(h, w.up, w.up_bias)), w.down, w.down_bias)


def _route_softmax(h: torch.Tensor, w: MoeWeights, cfg: MoeConfig):
    logits = F.linear(h, w.router).float()
    top_logits, top_idx = logits.topk(cfg.top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1).type_as(h), top_idx


def _route_sigmoid_groups(h: torch.Tensor, w: MoeWeights, cfg: MoeConfig):
    scores = F.linear(h.float(), w.router.float()).sigmoid()
    choice = scores + w.score_bias
    num_tokens, per_group = h.shape[0], cfg.num_experts // cfg.num_groups
    group_scores = choice.view(num_tokens, cfg.num_groups, per_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, -1)
    choice = choice.masked_fill(~keep.bool(), float("-inf"))
    top_idx = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_idx)
    if cfg.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * cfg.routed_scaling_factor, top_idx


def _experts(x: torch.Tensor, w: MoeWeights, top_w: torch.Tensor,
             top_idx: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's top-k experts, expert by expert (only experts hit)."""
    num_experts = w.experts_up.shape[0]
    out = torch.zeros(x.shape, dtype=top_w.dtype, device=x.device)
    hit = torch.zeros(num_experts, dtype=torch.long, device=x.device)
    hit.scatter_add_(0, top_idx.reshape(-1), torch.ones_like(top_idx.reshape(-1)))
    for e in hit.nonzero().flatten().tolist():
        token_idx, k_pos = torch.where(top_idx == e)
        order = torch.argsort(k_pos * x.shape[0] + token_idx)  # transformers' (k, token) order
        token_idx, k_pos = token_idx[order], k_pos[order]
        up = F.linear(x[token_idx], w.experts_up[e])
        act = silu_and_mul(up) if w.is_gated else relu2(up)
        y = F.linear(act, w.experts_down[e]) * top_w[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out.to(x.dtype)


def moe(h: torch.Tensor, w: MoeWeights, cfg: MoeConfig) -> torch.Tensor:
    """Routed experts plus the shared expert: ``[T, hidden] -> [T, hidden]``."""
    if cfg.num_experts == 0:  # dense Granite: the shared MLP alone
        return mlp(h, w.shared)
    if cfg.router == "softmax":
        top_w, top_idx = _route_softmax(h, w, cfg)
    else:
        top_w, top_idx = _route_sigmoid_groups(h, w, cfg)
    x = h if w.latent_in is None else F.linear(h, w.latent_in, w.latent_in_bias)
    out = _experts(x, w, top_w, top_idx)
    if w.latent_out is not None:
        out = F.linear(out, w.latent_out, w.latent_out_bias)
    return out + mlp(h, w.shared) if w.shared is not None else out
