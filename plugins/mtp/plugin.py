"""Registers the speculative-decoding proposers of this package."""

from heron.core.hookspecs import hookimpl


@hookimpl
def heron_register_proposers(register):
    register("ngram", _build_ngram)


def _build_ngram(config, runner):
    from heron.plugins.mtp.ngram import NgramProposer
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
