"""The MTP module as a trainable torch module, built from transformers' own decoder layer
and rotary embedding for the target's config: ``heron train-mtp`` trains it, the tests hold
heron's drafter (`heron.plugins.mtp.drafter`) against it, and `save` writes it in either
checkpoint layout (`heron.plugins.mtp.weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class MtpModule(nn.Module):
    """``forward(hidden, tokens)`` over whole sequences: ``hidden [B, T, H]`` the target's
    final hidden states at positions ``0 .. T-1``, ``tokens [B, T]`` the token after each
    (``t_{j+1}``); returns the layer's output ``[B, T, H]`` (causal), whose `logits`
    predict ``t_{j+2}``. Training passes rows at other ``positions [T]`` (chained drafts'
    rows) with their own attention ``mask [T, T]`` (True: attends). ``embed`` and ``head``
    (``[V', H]``, the rows of ``draft_ids``) are the target's and stay frozen. With
    ``hidden_layer`` the hidden states are the output of the target's layer
    ``hidden_layer`` (`heron.plugins.mtp.weights`), not its final ones."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor,
                 draft_ids: torch.Tensor | None = None, deepseek: bool = True,
                 hidden_layer: int | None = None) -> None:
        super().__init__()
        from transformers import AutoModel
        config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # causal without a mask
        base = AutoModel.from_config(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm = type(base.norm)
        self.deepseek = deepseek
        self.enorm, self.hnorm, self.out_norm = (norm(hidden, eps=eps) for _ in range(3))
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer, self.rotary = base.layers[0], base.rotary_emb
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("head", head.detach().float(), persistent=False)
        self.draft_ids = draft_ids
        self.hidden_layer = hidden_layer

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor,
                positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        positions = positions[None].expand_as(tokens)
        e = nn.functional.embedding(tokens, self.embed)
        if self.deepseek:
            e = e.masked_fill((positions == 0)[..., None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        out = self.layer(x, attention_mask=None if mask is None else mask[None, None],
                         position_ids=positions, position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (``head``'s rows) from `forward`'s output."""
        return nn.functional.linear(self.out_norm(out), self.head)

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft position reads in place of the target's hidden state."""
        return out if self.deepseek else self.out_norm(out)

    def tensors(self, num_target_layers: int) -> dict[str, torch.Tensor]:
        """The module's tensors under their checkpoint names: DeepSeek-V3's
        ``model.layers.{num_target_layers}.`` or, with ``deepseek=False``, Qwen3-Next's
        ``mtp.`` (norms zero-centred)."""
        layer = {k: v for k, v in self.layer.state_dict().items() if "rotary" not in k}
        if self.deepseek:
            p = f"model.layers.{num_target_layers}."
            out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                   p + "eh_proj.weight": self.eh_proj.weight,
                   p + "shared_head.norm.weight": self.out_norm.weight,
                   **{p + k: v for k, v in layer.items()}}
            if self.draft_ids is not None:
                out[p + "shared_head.head.weight"] = self.head
        else:
            p = "mtp."
            out = {p + "fc.weight": self.eh_proj.weight,
                   p + "pre_fc_norm_embedding.weight": self.enorm.weight - 1,
                   p + "pre_fc_norm_hidden.weight": self.hnorm.weight - 1,
                   p + "norm.weight": self.out_norm.weight - 1,
                   **{p + "layers.0." + k: v - 1 if "norm" in k else v
                      for k, v in layer.items()}}
        if self.draft_ids is not None:
            out[p + "draft_token_ids"] = self.draft_ids.long()
        if self.hidden_layer is not None:
            out[p + "hidden_layer"] = torch.tensor(self.hidden_layer)
        return {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
                for k, v in out.items()}

    def save(self, path: Path, num_target_layers: int) -> None:
        from safetensors.torch import save_file
        save_file(self.tensors(num_target_layers), str(path))
