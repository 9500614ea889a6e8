"""The plugin manager: built-in and third-party plugins, loaded the same way.

Built-ins are listed in `DEFAULT_PLUGINS` and as entry points; third-party plugins come
from the ``heron`` entry-point group. ``HERON_LOAD_PLUGINS`` (comma-separated names) limits
which load; ``HERON_TRACE_PLUGINS=1`` traces every hook call.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass, field

import pluggy

from heron.core import hookspecs
from heron.core.family import FamilySpec
from heron.core.kernels import register_kernel_file

DEFAULT_PLUGINS = ("heron.plugins.transformer.plugin", "heron.plugins.hybrid_ssm.plugin",
                   "heron.plugins.mtp.plugin",
                   "heron.plugins.lora.plugin", "heron.plugins.nllb.plugin",
                   "heron.plugins.bert.plugin")
ENTRY_POINT_GROUP = "heron"


class PluginError(RuntimeError):
    pass


@dataclass
class PluginInfo:
    name: str
    module: str
    version: str | None
    families: list[str] = field(default_factory=list)
    kernel_files: list[str] = field(default_factory=list)


class PluginManager:
    """Loads plugins once and holds what they registered."""

    def __init__(self, *, load_entry_points: bool = True,
                 allow: list[str] | None = None) -> None:
        self.pm = pluggy.PluginManager("heron")
        self.pm.add_hookspecs(hookspecs)
        if os.environ.get("HERON_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
            self.pm.enable_tracing()
        env_allow = os.environ.get("HERON_LOAD_PLUGINS")
        if allow is None and env_allow is not None:
            allow = [name.strip() for name in env_allow.split(",") if name.strip()]
        self._allow = allow
        self.plugins: dict[str, PluginInfo] = {}
        self.families: dict[str, FamilySpec] = {}
        self.adapter_loaders: dict[str, object] = {}  # format name -> load callable
        self.proposers: dict[str, object] = {}  # speculative method -> build callable
        for module in DEFAULT_PLUGINS:
            self._load(module.rsplit(".", 2)[-2], module, None)
        if load_entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                self._load(ep.name, ep.value, ep.dist.version if ep.dist else None)

    def _load(self, name: str, module_name: str, version: str | None) -> None:
        if self._allow is not None and name not in self._allow:
            return
        if name in self.plugins or self.pm.has_plugin(name):
            return
        module = importlib.import_module(module_name)
        self.register(module, name=name, version=version)

    def register(self, plugin: object, *, name: str, version: str | None = None) -> None:
        """Add a plugin object or module and collect what it registers.

        A hook implementation whose name is not in `hookspecs` fails here, loudly.
        """
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        module = getattr(plugin, "__name__", type(plugin).__module__)
        if version is None:
            version = getattr(plugin, "__version__", None) or _heron_version()
        self.plugins[name] = PluginInfo(name, module, version)
        self._call_for(name, "heron_register_families",
                       register=lambda spec: self._register_family(name, spec))
        self._call_for(name, "heron_register_kernels",
                       register=lambda path, names, defines=None: self._register_kernel_file(
                           name, path, names, defines))
        self._call_for(name, "heron_register_adapter_loaders",
                       register=lambda fmt, load: self._register_adapter_loader(name, fmt,
                                                                                load))
        self._call_for(name, "heron_register_proposers",
                       register=lambda method, build: self._register_proposer(name, method,
                                                                              build))

    def _call_for(self, name: str, hook: str, **kwargs) -> list:
        """Call ``hook`` on plugin ``name`` alone, so what it registers is attributed to it."""
        others = [p for n, p in self.pm.list_name_plugin() if n != name]
        return self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)

    def _register_family(self, plugin_name: str, spec: FamilySpec) -> None:
        if not isinstance(spec, FamilySpec):
            raise PluginError(f"plugin {plugin_name!r} registered {spec!r}, not a FamilySpec")
        if spec.name in self.families:
            raise PluginError(f"model family {spec.name!r} is registered twice "
                              f"(again by plugin {plugin_name!r})")
        self.families[spec.name] = spec
        self.plugins[plugin_name].families.append(spec.name)

    def _register_adapter_loader(self, plugin_name: str, fmt: str, load) -> None:
        if fmt in self.adapter_loaders:
            raise PluginError(f"adapter format {fmt!r} is registered twice "
                              f"(again by plugin {plugin_name!r})")
        self.adapter_loaders[fmt] = load

    def _register_proposer(self, plugin_name: str, method: str, build) -> None:
        if method in self.proposers:
            raise PluginError(f"speculative method {method!r} is registered twice "
                              f"(again by plugin {plugin_name!r})")
        self.proposers[method] = build

    def _register_kernel_file(self, plugin_name: str, path, names, defines) -> None:
        entry = register_kernel_file(path, names, defines)
        self.plugins[plugin_name].kernel_files.append(str(entry.path))

    def family_for(self, *, name: str | None = None, architecture: str | None = None,
                   gguf_architecture: str | None = None) -> FamilySpec:
        """The family named, or the one serving an HF or GGUF architecture."""
        if name is not None:
            if name not in self.families:
                raise PluginError(f"no model family {name!r}; loaded: {sorted(self.families)}")
            return self.families[name]
        for spec in self.families.values():
            if architecture in spec.architectures or gguf_architecture in spec.gguf_architectures:
                return spec
        what = architecture or gguf_architecture
        raise PluginError(f"no loaded plugin serves architecture {what!r}; "
                          f"families: {sorted(self.families)}")


def _heron_version() -> str | None:
    try:
        return importlib.metadata.version("heron")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_family(spec: FamilySpec):
    """Import and return the callable behind ``spec.loader`` (``"module:callable"``)."""
    module_name, _, attr = spec.loader.partition(":")
    return getattr(importlib.import_module(module_name), attr)
