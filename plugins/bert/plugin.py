"""Registers the bert family (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT,
DeBERTa-v2/v3, NomicBERT and GTE encoders: embedding models and cross-encoders; all but
DeBERTa and GTE also from llama.cpp GGUF files)."""

from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl
from heron.plugins.bert.config import ARCHITECTURES


@hookimpl
def heron_register_families(register):
    register(FamilySpec(name="bert", loader="heron.plugins.bert.loader:load",
                        architectures=ARCHITECTURES,
                        gguf_architectures=("bert", "nomic-bert", "modern-bert")))
