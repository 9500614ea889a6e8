"""Registers the decoder-only transformer family (Granite, Llama, Mistral, OLMo 2 and 3,
Phi-3, Qwen2, Qwen3, SmolLM2, SmolLM3)."""

from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl
from heron.plugins.transformer.config import (ARCHITECTURES, BARE_ARCHITECTURES,
                                             CLASSIFIER_ARCHITECTURES)


@hookimpl
def heron_register_families(register):
    register(FamilySpec(
        name="transformer",
        loader="heron.plugins.transformer.loader:load",
        architectures=(*ARCHITECTURES, *BARE_ARCHITECTURES, *CLASSIFIER_ARCHITECTURES),
        gguf_architectures=("granite", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3",
                            "smollm3"),
    ))
