"""The plugin API: every hook a heron plugin may implement.

Implement a hook with ``@heron.core.hookimpl`` in a module listed under the ``heron``
entry-point group (``plugin_template/`` is a worked example). A hook name not defined here
fails at start-up. The lifecycle:

1. **Start-up** (the hooks below): each hook runs once per plugin when the plugin manager
   loads it, and hands the plugin a ``register`` callback. Registering must be cheap: no
   model loading, no compiling, no CUDA.
2. **Load**: when a model's architecture matches a registered `FamilySpec`, the engine
   imports and calls its ``loader`` once; it returns a `LoadedModel`.
3. **Serve**: the engine drives the loaded `ModelRunner` (``heron.core.family``) with plain
   method calls: ``cache_spec`` and ``bind_cache`` once, then ``alloc_sequence``,
   ``forward`` and ``free_sequence`` as sequences run. No hook is called per step.
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


@hookspec
def heron_register_proposers(register):
    """Register speculative-decoding proposers (`heron.core.speculative.Proposer`), chosen
    by ``[speculative] method``.

    Called once when the plugin manager starts. Must be cheap.

    :param register: call ``register(name, build)`` per proposer, where
        ``build(config, runner)`` gets the engine's `heron.core.config.Config` (its
        ``speculative`` section holds the proposer's settings) and the loaded
        `ModelRunner`, and returns a `Proposer`, or raises ValueError saying why it cannot
        serve this model.
    """
