"""The plugin API: documented hooks, registration, allow-lists, layering, no CUDA at import."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest

from heron.core import hookspecs
from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl
from heron.core.kernel_check import check_kernels, compiler_available
from heron.core import kernels
from heron.core.kernels import registered_kernel_files
from heron.core.plugins import PluginError, PluginManager

ROOT = Path(__file__).resolve().parent.parent
HOOKS = [name for name in dir(hookspecs) if name.startswith("heron_")]
TESTS = (ROOT / "tests").rglob("test_*.py")


def test_every_hook_documents_each_parameter():
    for name in HOOKS:
        fn = getattr(hookspecs, name)
        doc = inspect.getdoc(fn) or ""
        params = list(inspect.signature(fn).parameters)
        assert doc.splitlines() and doc.splitlines()[0], f"{name} has no summary"
        for param in params:
            assert re.search(rf":param {param}:", doc), f"{name} does not document {param}"


def test_every_hook_has_a_test():
    text = "".join(p.read_text() for p in TESTS)
    for name in HOOKS:
        assert f"def test_hook_{name}" in text, f"add a test named test_hook_{name}"


class FakeFamily:
    @hookimpl
    def heron_register_families(self, register):
        register(FamilySpec(name="fake", loader="nowhere:load", architectures=("FakeForLM",)))


def test_hook_heron_register_families():
    pm = PluginManager(load_entry_points=False)
    pm.register(FakeFamily(), name="fake-plugin")
    assert pm.family_for(architecture="FakeForLM").name == "fake"
    assert pm.plugins["fake-plugin"].families == ["fake"]
    assert pm.family_for(architecture="LlamaForCausalLM").name == "transformer"
    assert pm.family_for(gguf_architecture="llama").name == "transformer"
    with pytest.raises(PluginError, match="no loaded plugin serves"):
        pm.family_for(architecture="GPT2LMHeadModel")
    with pytest.raises(PluginError, match="registered twice"):
        pm.register(type("Again", (FakeFamily,), {})(), name="again")


def test_hook_heron_register_kernels(tmp_path):
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n')

    class KernelPlugin:
        @hookimpl
        def heron_register_kernels(self, register):
            register(source, ["k"], {"N": 4})

    pm = PluginManager(load_entry_points=False)
    try:
        pm.register(KernelPlugin(), name="kernels")
        assert pm.plugins["kernels"].kernel_files == [str(source.resolve())]
        (entry,) = [f for f in registered_kernel_files() if f.path == source.resolve()]
        assert entry.kernel_names == ["k"] and entry.define_sets == [{"N": 4}]
        (result,) = check_kernels(("sm_90",), files=[entry])  # as `heron kernels --check`
        assert result.ok or compiler_available() is None, result.message
    finally:
        kernels._REGISTRY.pop(source.resolve(), None)


def test_hook_heron_register_adapter_loaders():
    def load(name, path, targets, max_rank):
        raise NotImplementedError

    class FakeFormat:
        @hookimpl
        def heron_register_adapter_loaders(self, register):
            register("fake-format", load)

    pm = PluginManager(load_entry_points=False)
    pm.register(FakeFormat(), name="fake-format-plugin")
    assert pm.adapter_loaders["fake-format"] is load
    from heron.plugins.lora.plugin import load_adapter
    assert pm.adapter_loaders["peft"] is load_adapter  # the built-in lora plugin
    with pytest.raises(PluginError, match="adapter format 'fake-format' is registered twice"):
        pm.register(type("Again", (FakeFormat,), {})(), name="again")


def test_hook_heron_register_proposers():
    def build(config, runner):
        raise NotImplementedError

    class FakeProposer:
        @hookimpl
        def heron_register_proposers(self, register):
            register("fake-drafts", build)

    pm = PluginManager(load_entry_points=False)
    pm.register(FakeProposer(), name="fake-proposer-plugin")
    assert pm.proposers["fake-drafts"] is build
    assert "ngram" in pm.proposers  # the built-in mtp plugin
    with pytest.raises(PluginError, match="speculative method 'fake-drafts' is registered twice"):
        pm.register(type("Again", (FakeProposer,), {})(), name="again")


def test_misspelled_hook_fails_at_registration():
    class Typo:
        @hookimpl
        def heron_register_familes(self, register):
            pass

    pm = PluginManager(load_entry_points=False)
    with pytest.raises(pluggy.PluginValidationError):
        pm.register(Typo(), name="typo")


def test_allow_list_limits_loaded_plugins(monkeypatch):
    monkeypatch.setenv("HERON_LOAD_PLUGINS", "nothing-by-this-name")
    assert PluginManager().families == {}
    monkeypatch.setenv("HERON_LOAD_PLUGINS", "transformer")
    assert set(PluginManager().families) == {"transformer"}


def test_trace_env_traces_hook_calls():
    code = "from heron.core.plugins import PluginManager; PluginManager()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"HERON_TRACE_PLUGINS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "heron_register_families" in result.stderr


def test_importing_plugins_does_no_heavy_work():
    code = ("import sys, heron.core.plugins as p; m = p.PluginManager(); "
            "import torch; print(torch.cuda.is_initialized(), "
            "'heron.plugins.transformer.model' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_core_never_imports_plugins_or_server():
    bad = []
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.startswith(("heron.plugins", "heron.server", "plugins", "server"))]
    assert not bad, bad
