"""Registers the nllb family (NLLB-200 and M2M100 encoder-decoder translation)."""

from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl


@hookimpl
def heron_register_families(register):
    register(FamilySpec(
        name="nllb",
        loader="heron.plugins.nllb.loader:load",
        architectures=("M2M100ForConditionalGeneration",),
    ))
