"""The plugin API: every hook a heron plugin may implement.

Hooks run once, at start-up, and hand the plugin a ``register`` callback. What a plugin
registers is then called directly on the hot path; no hook is called per step.
Implement a hook with ``@heron.core.hookimpl`` in a module listed under the ``heron``
entry-point group.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("heron")
hookimpl = pluggy.HookimplMarker("heron")


# -- start-up: what the plugin provides -----------------------------------------------------

@hookspec
def heron_register_families(register):
    """Register model families this plugin serves.

    Called once when the plugin manager starts. Must be cheap: no model loading, no CUDA.

    :param register: call ``register(FamilySpec(...))`` once per family; a name already
        registered by another plugin raises `PluginError`.
    """


@hookspec
def heron_register_kernels(register):
    """Register CUDA kernel source files this plugin ships, so they are compile-checked.

    Called once when the plugin manager starts; `heron kernels --check` then compiles every
    registered variant, and `heron.core.ops.launch_kernel` builds the ones a model uses.
    Must not compile.

    :param register: call ``register(path, kernel_names, defines=None)`` per ``.cu`` file;
        ``kernel_names`` are its ``extern "C"`` kernels, ``defines`` a dict of ``-D`` values
        (register the file once per define set it is used with).
    """


@hookspec
def heron_register_adapter_loaders(register):
    """Register readers of LoRA adapter files (e.g. PEFT directories).

    Called once when the plugin manager starts. Must be cheap: no adapter loading.

    :param register: call ``register(format_name, load)`` per format, where
        ``load(name, path, targets, max_rank)`` returns an `heron.core.lora.AdapterWeights`
        for the base model's `heron.core.lora.LoraTarget` list, or raises
        `heron.core.lora.AdapterError` naming the adapter and the problem.
    """
