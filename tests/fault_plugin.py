"""A test plugin: the ``faulty`` family serves any checkpoint through its real family, and
misbehaves on marked requests, so fault isolation is tested below the engine, where a
real family's bug would be.

A prompt that starts with two `RAISE` tokens makes ``forward`` raise in every step it is
part of; two `NAN` tokens make its logits rows NaN; two `ALLOC` tokens make
``alloc_sequence`` raise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from heron.core import (Batch, CacheSpec, CacheTensors, FamilySpec, LoadedModel, ModelRunner,
                        PluginManager, Sequence, hookimpl)
from heron.core.plugins import load_family

RAISE, NAN, ALLOC = 297, 298, 299


def marked(seq: Sequence, token: int) -> bool:
    return seq.prompt_token_ids[:2] == [token, token]


class FaultyRunner(ModelRunner):
    def __init__(self, inner: ModelRunner) -> None:
        self.inner, self.info = inner, inner.info
        self.generated_matches_prompt = inner.generated_matches_prompt

    def cache_spec(self) -> CacheSpec:
        return self.inner.cache_spec()

    def bind_cache(self, cache: CacheTensors) -> None:
        self.inner.bind_cache(cache)

    def alloc_sequence(self, seq: Sequence):
        if marked(seq, ALLOC):
            raise RuntimeError("injected fault in alloc_sequence")
        return self.inner.alloc_sequence(seq)

    def free_sequence(self, seq: Sequence) -> None:
        self.inner.free_sequence(seq)

    def lora_targets(self):
        return self.inner.lora_targets()

    def forward(self, batch: Batch) -> torch.Tensor:
        if any(marked(seq, RAISE) for seq in batch.seqs):
            raise RuntimeError("injected fault in forward")
        logits = self.inner.forward(batch).clone()  # an inference tensor: not writable here
        qsl = batch.attn.query_start_loc.tolist()
        for row, token in enumerate(batch.logits_indices.tolist()):
            i = next(i for i in range(len(batch.seqs)) if qsl[i] <= token < qsl[i + 1])
            if marked(batch.seqs[i], NAN):
                logits[row] = float("nan")
        return logits


def load(path: str, model_config, device, dtype) -> LoadedModel:
    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    spec = PluginManager(load_entry_points=False).family_for(architecture=arch)
    loaded = load_family(spec)(path, model_config, device, dtype)
    return LoadedModel(FaultyRunner(loaded.runner), loaded.tokenizer)


@hookimpl
def heron_register_families(register):
    register(FamilySpec(name="faulty", loader="tests.fault_plugin:load"))


def plugins() -> PluginManager:
    """heron's plugins plus this one; pass to ``Engine(config, plugins)`` with
    ``model.family = "faulty"``."""
    import tests.fault_plugin as me
    pm = PluginManager()
    pm.register(me, name="faulty")
    return pm
