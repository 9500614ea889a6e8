"""Registers the PEFT LoRA adapter format (``adapter_config.json`` +
``adapter_model.safetensors`` directories)."""

from heron.core.hookspecs import hookimpl


def load_adapter(name, path, targets, max_rank):
    """`heron.plugins.lora.peft_format.load_adapter`, imported on first use so that loading
    the plugin stays cheap."""
    from heron.plugins.lora.peft_format import load_adapter as load
    return load(name, path, targets, max_rank)


@hookimpl
def heron_register_adapter_loaders(register):
    register("peft", load_adapter)
