"""Registers the speculative-decoding proposers of this package: prompt lookup (``ngram``)
and multi-token-prediction heads (``mtp``)."""

from heron.core.hookspecs import hookimpl


@hookimpl
def heron_register_proposers(register):
    register("ngram", _build_ngram)
    register("mtp", _build_mtp)


def _build_ngram(config, runner):
    from heron.plugins.mtp.ngram import NgramProposer
    spec = config.speculative
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _build_mtp(config, runner):
    from pathlib import Path

    import torch

    from heron.plugins.mtp.drafter import MtpProposer
    from heron.plugins.mtp.weights import DraftTarget, load_mtp
    target = DraftTarget.of(getattr(runner, "model", None))
    path = config.speculative.model or config.model.path
    if not path or Path(path).suffix == ".gguf":
        raise ValueError("speculative method 'mtp' needs MTP weights: set [speculative] "
                         "model to a safetensors file or directory that holds them (the "
                         "model's own checkpoint is used when it is one)")
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"[speculative] model {str(path)!r} does not exist")
    spec = config.speculative
    dtype = None if spec.draft_dtype == "auto" else getattr(torch, spec.draft_dtype)
    return MtpProposer(load_mtp(path, target, dtype), target, spec.confidence_threshold,
                       config.engine.block_size, int(spec.prefix_store_mb * 2**20))
