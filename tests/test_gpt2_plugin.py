"""The heron-gpt2 plugin (plugin_template/), installed the way a third party's would be, served
over HTTP: logits and greedy tokens against transformers, prefix-cache hits, /v1/models; its
CUDA kernel run through the CPU emulator; its imports limited to heron's public API."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import heron.core
import heron.core.ops
from heron.core import Engine, PluginManager
from heron.core.ops.cuda.launch import use_backend
from heron.core.speculative import Proposer
from tests.gpu.cases import assert_close
from tests.gpu.emulator import EmulatorBackend, compiler_available
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

TEMPLATE = Path(__file__).resolve().parent.parent / "plugin_template"
NAME = "tiny-gpt2"
NUM_NEW = 32
BS = 8  # conf/test.toml


def test_the_plugin_is_installed_and_registered():
    dist = importlib.metadata.distribution("heron-gpt2")  # `make test` installs plugin_template/
    assert Path(dist.locate_file("heron_gpt2")).resolve() != TEMPLATE / "src" / "heron_gpt2"
    pm = PluginManager()
    assert pm.family_for(architecture="GPT2LMHeadModel").name == "gpt2"
    info = pm.plugins["gpt2"]
    assert info.module == "heron_gpt2.plugin" and info.version == "0.1.0"
    assert [Path(f).name for f in info.kernel_files] == ["gelu.cu"]
    listed = subprocess.run([sys.executable, "-m", "heron.server.cli", "plugins"],
                            capture_output=True, text=True, check=True).stdout
    assert "gpt2 0.1.0 (heron_gpt2.plugin) families: gpt2 kernels: 1 file(s)" in listed


def test_the_plugin_imports_only_heron_public_api():
    public = {"heron.core": set(heron.core.__all__), "heron.core.ops": set(heron.core.ops.__all__)}
    sources = list((TEMPLATE / "src").rglob("*.py")) + list((TEMPLATE / "tests").rglob("*.py"))
    assert len(sources) >= 7
    bad = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{path.name}: import {a.name}" for a in node.names
                        if a.name.startswith("heron.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("heron."):
                names = {a.name for a in node.names}
                if node.module not in public or not names <= public[node.module]:
                    bad.append(f"{path.name}: from {node.module} import {sorted(names)}")
    assert not bad, f"private heron imports in the template: {bad}"


def test_loading_the_plugin_is_cheap():
    code = ("import sys, torch; from heron.core import PluginManager; PluginManager(); "
            "print(torch.cuda.is_initialized(), 'heron_gpt2.model' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.skipif(not compiler_available(), reason="needs g++ for the kernel emulator")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_kernel_matches_its_reference_in_the_emulator(dtype):
    from heron_gpt2.ops import gelu_tanh_cuda, gelu_tanh_ref
    x = (torch.randn(3, 700) * 3).to(dtype)
    backend = EmulatorBackend(num_sms=2)
    with use_backend(backend):
        out = gelu_tanh_cuda(x)
    assert [name for name, *_ in backend.launches] == ["gelu_tanh_kernel"]
    assert_close(out, gelu_tanh_ref(x.float()).to(dtype), dtype, "gelu_tanh")


# -- served over HTTP --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    model = build_tiny("gpt2", path)
    engine = Engine(server_config(path, **{"server.served_model_name": NAME}))
    with ServerThread(engine.config, engine) as server:
        yield model, engine, server


def reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its log-probabilities over prompt + tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, do_sample=False)[0].tolist()
        logits = model(torch.tensor([out])).logits[0]
    return out[len(prompt):], torch.log_softmax(logits.double(), -1)


def test_logprobs_and_greedy_tokens_match_transformers_over_http(tiny):
    model, engine, server = tiny
    prompt = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    tokens, ref = reference(model, prompt)
    out = server.client().completions.create(
        model=NAME, prompt=prompt, max_tokens=NUM_NEW, temperature=0.0, logprobs=5, echo=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0]
    lp = out.logprobs
    ids = prompt + tokens
    assert lp.tokens == [f"token_id:{i}" for i in ids]
    assert lp.token_logprobs[0] is None
    worst = 0.0
    for i in range(1, len(ids)):
        worst = max(worst, abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()),
                    abs(max(lp.top_logprobs[i].values()) - ref[i - 1].max().item()))
    assert worst <= 1e-4, f"max abs log-prob error {worst:.2e}"
    assert ref.exp().max(-1).values.min() < 0.9  # the distributions are not one-hot
    assert engine.num_blocks_in_use == 0


def test_prefix_cache_hits_for_gpt2(tiny):
    model, engine, server = tiny
    client = server.client()
    salt = {"cache_salt": uuid.uuid4().hex, "ignore_eos": True, "return_tokens_as_token_ids": True}
    shared = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    usages = []
    for tail in ([7, 8, 9], [10, 11]):
        r = client.completions.create(model=NAME, prompt=shared + tail, max_tokens=NUM_NEW,
                                      temperature=0.0, logprobs=0, extra_body=salt)
        usages.append(r.usage.prompt_tokens_details.cached_tokens)
        tokens, _ = reference(model, shared + tail)
        assert r.choices[0].logprobs.tokens == [f"token_id:{i}" for i in tokens]  # hit or not
    assert usages == [0, len(shared) // BS * BS]
    assert engine.num_blocks_in_use == 0


def test_models_lists_gpt2(tiny):
    _, engine, server = tiny
    (card,) = server.client().models.list().data
    assert card.id == NAME and card.max_model_len == 512 == engine.max_model_len


def test_a_family_without_hidden_states_neither_embeds_nor_feeds_a_drafter(tiny):
    """A family that keeps no hidden states is refused what needs them, with its name."""
    _, engine, _ = tiny

    class HiddenStateDrafter(Proposer):
        needs_hidden_states = True

        def propose(self, seqs, k):
            return [[] for _ in seqs]

    with pytest.raises(ValueError, match="keeps no hidden states"):
        engine.set_proposer(HiddenStateDrafter())
    with pytest.raises(ValueError, match="does not serve embeddings"):
        Engine(server_config(engine.config.model.path, **{"model.task": "embed"}))
