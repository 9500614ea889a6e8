"""GPT-2 math over heron's paged KV cache.

Plain tensors and functional ops. transformers stores GPT-2's projections as ``Conv1D``
(weight ``[in, out]``); they are transposed once at load into ``[out, in]`` so heron's
`linear` (and its packed CPU weights) applies. Positions are learned embeddings, indexed by
``batch.positions``, so a token's KV depends only on the tokens before it: prefix caching
and chunked prefill need nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core import Batch, CacheTensors
from heron.core.ops import linear, pack_weight, paged_attention, write_kv
from heron_gpt2.config import GPT2Config
from heron_gpt2.ops import gelu_tanh

#: Buffers older checkpoints carry (the causal mask), not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


@dataclass
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, eps)


@dataclass
class Block:
    ln_1: LayerNorm
    qkv: torch.Tensor          # [3 * hidden, hidden]: q, k, v rows
    qkv_bias: torch.Tensor
    attn_out: torch.Tensor     # [hidden, hidden]
    attn_out_bias: torch.Tensor
    ln_2: LayerNorm
    fc: torch.Tensor           # [inner, hidden]
    fc_bias: torch.Tensor
    proj: torch.Tensor         # [hidden, inner]
    proj_bias: torch.Tensor
    scale: float               # of the attention scores


class Checkpoint:
    """Takes tensors by their transformers name, with or without the ``transformer.``
    prefix (``GPT2LMHeadModel`` checkpoints have it, ``GPT2Model`` ones do not)."""

    def __init__(self, tensors: dict[str, torch.Tensor], device, dtype) -> None:
        self.tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()
                        if not name.endswith(_BUFFERS)}
        self.device, self.dtype = device, dtype

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.tensors.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

    def conv1d(self, name: str) -> torch.Tensor:
        """A ``Conv1D`` weight ``[in, out]`` as a packed linear weight ``[out, in]``."""
        return pack_weight(self.take(name).t().contiguous())

    def layer_norm(self, name: str) -> LayerNorm:
        return LayerNorm(self.take(name + ".weight"), self.take(name + ".bias"))


class GPT2Model:
    def __init__(self, cfg: GPT2Config, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.activation = F.gelu if cfg.activation == "gelu" else gelu_tanh
        ckpt = Checkpoint(tensors, device, dtype)
        self.wte = ckpt.take("wte.weight")
        self.wpe = ckpt.take("wpe.weight")
        self.blocks = [self._block(ckpt, i) for i in range(cfg.num_layers)]
        self.ln_f = ckpt.layer_norm("ln_f")
        if cfg.tie_word_embeddings:
            ckpt.tensors.pop("lm_head.weight", None)  # a copy of wte, when one was saved
            self.lm_head = pack_weight(self.wte)
        else:
            self.lm_head = pack_weight(ckpt.take("lm_head.weight"))
        self.unused_tensors = sorted(ckpt.tensors)

    def _block(self, ckpt: Checkpoint, i: int) -> Block:
        cfg, p = self.cfg, f"h.{i}."
        scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= i + 1
        return Block(
            ln_1=ckpt.layer_norm(p + "ln_1"),
            qkv=ckpt.conv1d(p + "attn.c_attn.weight"),
            qkv_bias=ckpt.take(p + "attn.c_attn.bias"),
            attn_out=ckpt.conv1d(p + "attn.c_proj.weight"),
            attn_out_bias=ckpt.take(p + "attn.c_proj.bias"),
            ln_2=ckpt.layer_norm(p + "ln_2"),
            fc=ckpt.conv1d(p + "mlp.c_fc.weight"),
            fc_bias=ckpt.take(p + "mlp.c_fc.bias"),
            proj=ckpt.conv1d(p + "mlp.c_proj.weight"),
            proj_bias=ckpt.take(p + "mlp.c_proj.bias"),
            scale=scale,
        )

    def attention(self, h: torch.Tensor, block: Block, batch: Batch,
                  kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Causal self-attention of ``h [T, hidden]``: this step's K/V go into the paged
        cache first, then every query attends to its sequence's cached K/V."""
        cfg = self.cfg
        qkv = linear(h, block.qkv, block.qkv_bias)
        q, k, v = qkv.view(-1, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        k_cache, v_cache = kv
        write_kv(k, v, k_cache, v_cache, batch.attn.slot_mapping)
        o = paged_attention(q.contiguous(), k_cache, v_cache, batch.attn, block.scale)
        return linear(o.reshape(-1, cfg.hidden_size), block.attn_out, block.attn_out_bias)

    def mlp(self, h: torch.Tensor, block: Block) -> torch.Tensor:
        return linear(self.activation(linear(h, block.fc, block.fc_bias)), block.proj,
                      block.proj_bias)

    def forward(self, batch: Batch, cache: CacheTensors) -> torch.Tensor:
        """Float32 logits for ``batch.logits_indices``; writes every token's KV."""
        eps = self.cfg.layer_norm_eps
        x = F.embedding(batch.input_ids, self.wte) + F.embedding(batch.positions, self.wpe)
        for i, block in enumerate(self.blocks):
            x = x + self.attention(block.ln_1(x, eps), block, batch, cache.layer_kv(i))
            x = x + self.mlp(block.ln_2(x, eps), block)
        h = self.ln_f(x.index_select(0, batch.logits_indices), eps)
        return linear(h, self.lm_head).float()
