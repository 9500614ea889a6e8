"""Registers the hybrid_ssm family (Mamba2, Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1)."""

from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl
from heron.plugins.hybrid_ssm.config import ARCHITECTURES


@hookimpl
def heron_register_families(register):
    register(FamilySpec(
        name="hybrid_ssm",
        loader="heron.plugins.hybrid_ssm.loader:load",
        architectures=ARCHITECTURES,
    ))
