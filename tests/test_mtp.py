"""MTP drafting on a tiny Llama: heads in both checkpoint layouts, held against a reference
module built from transformers' own layers, trained by self-distillation, and lossless.

The head is trained here the way ``heron train-mtp`` trains one (on the model's own greedy
outputs and hidden states), so that drafts are often right and often wrong; a random head's
drafts are almost never accepted.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from heron.core.async_engine import EngineStats
from heron.core.sampling_params import SamplingParams
from heron.plugins.mtp.module import MtpModule
from heron.plugins.mtp.ngram import NgramIndex
from heron.plugins.mtp.prefix_store import PrefixStore
from heron.plugins.mtp.prompts import COPY, copy_prompts
from heron.plugins.mtp.train import (agreement, chain_mask, generate_samples, load_module,
                                     new_module, resolve_hidden_layer, train)
from heron.server.metrics import Metrics
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.tiny_models import build_tiny

MTP = {"speculative.method": "mtp", "speculative.num_speculative_tokens": 3}


def random_prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(4, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(num)]


# A random model's greedy text has no structure a head could learn in general, so the
# head learns these prompts' continuations, and the tests draft for these prompts.
PROMPTS = random_prompts(16, seed=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama whose checkpoint holds a trained MTP head (DeepSeek-V3 layout)."""
    path = tmp_path_factory.mktemp("llama-mtp")
    hf = build_tiny("llama", path)
    engine = make_engine(path, **{"prefix_cache.enabled": False})
    samples = generate_samples(engine, PROMPTS, max_tokens=40)
    torch.manual_seed(0)
    module = new_module(hf.config, engine.runner.model, None)
    losses = train(module, samples, epochs=150, lr=1e-2, batch_size=8, depth=3)
    assert losses[-1] < 0.6 * losses[0]
    module.save(path / "mtp.safetensors", hf.config.num_hidden_layers)
    return path, hf, module


def with_head(tmp_path, tiny, module: MtpModule):
    """A copy of the tiny model's directory whose MTP head is ``module``."""
    path, hf, _ = tiny
    shutil.copytree(path, tmp_path / "m")
    module.save(tmp_path / "m" / "mtp.safetensors", hf.config.num_hidden_layers)
    return tmp_path / "m"


class DraftRecorder:
    """Calls through to the engine's proposer; keeps each sequence's tokens and the drafts
    proposed after them."""

    def __init__(self, engine) -> None:
        self.inner, self.calls = engine.proposer, []
        engine.proposer = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, k):
        drafts = self.inner.propose(seqs, k)
        self.calls += [(list(s.token_ids), d) for s, d in zip(seqs, drafts)]
        return drafts


@torch.no_grad()
def hf_hidden(hf, tokens: list[int], layer: int | None = None) -> torch.Tensor:
    """transformers' hidden states ``[1, T, H]``: the final ones, or layer ``layer``'s
    output (counted from 1) through the final norm."""
    out = hf.model(torch.tensor([tokens]), output_hidden_states=layer is not None)
    if layer is None:
        return out.last_hidden_state
    norm = hf.model.norm if hasattr(hf.model, "norm") else hf.model.final_layernorm
    return norm(out.hidden_states[layer])


@torch.no_grad()
def reference_drafts(hf, module: MtpModule, tokens: list[int], k: int,
                     threshold: float = 0.0, ties: list[set[int]] | None = None) -> list[int]:
    """Drafts after ``tokens`` (the last not yet computed) from transformers' hidden states
    (those of the module's ``hidden_layer``) and the reference module, chaining by
    rerunning the whole sequence of pairs, while the product of the drafts' probabilities
    stays at or above ``threshold``. ``ties`` receives, per draft, the tokens whose
    probability is within float32 rounding (1e-5 relative) of the draft's."""
    hidden = hf_hidden(hf, tokens[:-1], module.hidden_layer)
    pairs = torch.tensor([tokens[1:]])
    drafts, chain = [], 1.0
    for _ in range(k):
        out = module(hidden, pairs)
        probs = torch.softmax(module.logits(out[0, -1]), -1)
        best = int(probs.argmax())
        if ties is not None:
            near = (probs >= probs[best] * (1 - 1e-5)).nonzero().flatten().tolist()
            ties.append({i if module.draft_ids is None else int(module.draft_ids[i])
                         for i in near})
        chain *= float(probs[best])
        if chain < threshold:
            break
        draft = best if module.draft_ids is None else int(module.draft_ids[best])
        drafts.append(draft)
        hidden = torch.cat([hidden, module.chained(out[:, -1:])], dim=1)
        pairs = torch.cat([pairs, torch.tensor([[draft]])], dim=1)
    return drafts


def agree(drafts: list[int], reference: list[int], ties: list[set[int]]) -> bool:
    """Whether ``drafts`` are ``reference``'s, up to a near tie (`reference_drafts`' ties)
    broken the other way, where the two chains part."""
    for draft, want, near in zip(drafts, reference, ties):
        if draft != want:
            return draft in near
    return len(drafts) == len(reference)


@pytest.mark.parametrize("layout, disable_by_batch_size", [
    ("deepseek", 0), ("qwen3-next+draft-vocab", 0),
    ("deepseek", 2),  # sequences draft again after steps without drafts
    ("deepseek+hidden-layer", 0),
])
def test_drafts_equal_the_reference_modules(tmp_path, tiny, layout, disable_by_batch_size):
    path, hf, trained = tiny
    if layout == "deepseek+hidden-layer":  # the same weights reading layer 1's output
        module = MtpModule(hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight,
                           hidden_layer=1)
        module.load_state_dict(trained.state_dict())
        path = with_head(tmp_path, tiny, module)
    elif layout != "deepseek":  # the same weights, Qwen3-Next's names, 200 draft tokens
        draft_ids = torch.randperm(320, generator=torch.Generator().manual_seed(3))[:200]
        draft_ids = draft_ids.sort().values
        module = MtpModule(hf.config, hf.model.embed_tokens.weight,
                           hf.lm_head.weight[draft_ids], draft_ids, deepseek=False)
        module.load_state_dict(trained.state_dict(), strict=False)
        path = with_head(tmp_path, tiny, module)
    else:
        module = trained
    engine = make_engine(path, **MTP, **{
        "prefix_cache.enabled": False, "engine.max_num_seqs": 3,
        "speculative.disable_by_batch_size": disable_by_batch_size})
    recorder = DraftRecorder(engine)
    engine.generate(PROMPTS[:5], [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0,
                                                 ignore_eos=True) for i in range(5)])
    # enough proposals to compare (how many depends on how many drafts the random weights
    # get accepted: 19 to 48 here)
    assert len(recorder.calls) > 12
    for tokens, drafts in recorder.calls:
        ties = []
        assert agree(drafts, reference_drafts(hf, module, tokens, 3, ties=ties), ties), tokens
    if layout.startswith("qwen3-next"):
        assert all(d in set(draft_ids.tolist()) for _, ds in recorder.calls for d in ds)
    assert_no_leaks(engine)


def test_a_confidence_threshold_ends_chains_the_head_is_unsure_of(tiny):
    """With ``confidence_threshold`` a sequence's drafts stop where the product of their
    probabilities would fall below it (chains end after different drafts, some never
    start); outputs stay the model's. The tiny head is unsure (its chains' probabilities
    are mostly 0.03-0.5, then 0.002-0.07), hence the low threshold."""
    path, hf, module = tiny
    threshold = 0.05
    overrides = {**MTP, "prefix_cache.enabled": False, "engine.max_num_seqs": 4}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids
             for o in make_engine(path, **overrides).generate(PROMPTS[:6], params)]
    engine = make_engine(path, **overrides, **{"speculative.confidence_threshold": threshold})
    recorder = DraftRecorder(engine)
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:6], params)] == plain
    lengths = set()
    for tokens, drafts in recorder.calls:
        assert drafts == reference_drafts(hf, module, tokens, 3, threshold), tokens
        lengths.add(len(drafts))
    assert {0, 1, 2} <= lengths, lengths
    assert not engine.proposer.caches
    assert_no_leaks(engine)


def test_a_bf16_head_drafts_almost_what_the_fp32_one_does_and_changes_no_output(tiny):
    """``draft_dtype = "bfloat16"``: the head's projections in bf16 (the rest stays fp32).
    Rounding may change a draft where the head's top two logits nearly tie, never an
    output."""
    path, hf, module = tiny
    overrides = {"prefix_cache.enabled": False, "engine.max_num_seqs": 4}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids
             for o in make_engine(path, **overrides).generate(PROMPTS[:8], params)]
    engine = make_engine(path, **overrides, **MTP, **{"speculative.draft_dtype": "bfloat16"})
    w = engine.proposer.w
    assert {w.proj.dtype, w.head.dtype, w.layer.gate_up.dtype, w.layer.attn.qkv.dtype} == {
        torch.bfloat16}
    assert w.out_norm.dtype == torch.float32
    recorder = DraftRecorder(engine)
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:8], params)] == plain
    same = total = 0
    for tokens, drafts in recorder.calls:
        want = reference_drafts(hf, module, tokens, 3)
        assert len(drafts) == len(want)
        same += drafts[0] == want[0]
        total += 1
    assert total > 30 and same >= 0.9 * total, (same, total)
    assert engine.spec_stats.accepted_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("store", [True, False])
def test_drafts_past_a_prefix_cache_hit_read_the_prefix_from_the_store(tiny, store):
    """A prompt that starts with one run before gets the target's KV of the shared blocks
    from the prefix cache and the head's K/V of them from its `PrefixStore`: its drafts are
    the reference module's over the whole sequence. Without the store the head starts at
    the hit, blind to the prefix, and some drafts differ."""
    path, hf, module = tiny
    engine = make_engine(path, **MTP, **{"engine.block_size": 16,
                                         "speculative.prefix_store_mb": 64 if store else 0})
    shared = PROMPTS[0] + PROMPTS[3] + PROMPTS[1]  # 41 tokens: two whole blocks
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.generate([shared + PROMPTS[2]], params)
    recorder = DraftRecorder(engine)
    engine.generate([shared + PROMPTS[4]], params)
    assert engine.scheduler.prefix_hit_tokens >= 32
    same = [drafts == reference_drafts(hf, module, tokens, 3)
            for tokens, drafts in recorder.calls]
    assert len(same) > 5 and all(same) == store
    assert_no_leaks(engine)


def test_prefix_store_keys_blocks_by_everything_they_read():
    """A block is found only under the same namespace and the same tokens up to the one
    after it (the module read it), only whole blocks, and the least recently used go
    first once the store is full."""
    store = PrefixStore(block_size=4, capacity_bytes=3 * 2 * 4 * 4)  # three blocks
    tokens = list(range(20, 40))
    k = torch.arange(12, dtype=torch.float32)[:, None]  # a position's K (and V): its index
    chain = []
    store.put(chain, tokens, "a", k, -k, 9)  # blocks 0, 1 (block 2 needs position 11)
    assert len(chain) == 2 and len(store.blocks) == 2
    got_k, got_v, got_chain = store.take(tokens, "a", 8)
    assert torch.equal(got_k, k[:8]) and torch.equal(got_v, -k[:8]) and got_chain == chain
    assert store.take(tokens, "b", 8) is None  # another adapter's hidden states
    assert store.take(tokens[:8] + [0] + tokens[9:], "a", 8) is None  # the token after
    assert store.take(tokens, "a", 6) is None and store.take(tokens, "a", 12) is None
    store.put(chain, tokens, "a", k, -k, 12)  # block 2: full
    store.take(tokens, "a", 4)  # block 0 used: block 1 is now the oldest
    store.put([], tokens, "b", k, -k, 4)  # a fourth block evicts it
    assert store.take(tokens, "a", 4) is not None and store.take(tokens, "a", 8) is None
    assert store.take(tokens, "b", 4) is not None


def test_prompt_lookup_drafts_where_it_matches_and_the_head_elsewhere(tiny):
    """With ``prompt_lookup`` a sequence whose last n-gram occurred before drafts what
    followed it, the others draft with the head; the head saw every position, those of the
    steps lookup drafted for too, so its drafts are the reference module's."""
    path, hf, module = tiny
    engine = make_engine(path, **MTP, **{"prefix_cache.enabled": False,
                                         "speculative.prompt_lookup": True,
                                         "speculative.prompt_lookup_min": 1})
    recorder = DraftRecorder(engine)
    engine.generate(PROMPTS[:6], SamplingParams(max_tokens=32, temperature=0.0,
                                                ignore_eos=True))
    looked_up = 0
    for tokens, drafts in recorder.calls:
        lookup = NgramIndex(1, 4).lookup(tokens, 3)  # random text: few longer matches
        assert drafts == (lookup or reference_drafts(hf, module, tokens, 3)), tokens
        looked_up += bool(lookup)
    assert 5 < looked_up < len(recorder.calls) - 5
    # the counts by source: each verification once, under the part that drafted it
    stats = engine.spec_stats
    parts = stats.by_source
    assert sorted(parts) == ["mtp", "ngram"] and 0 < parts["ngram"].drafts <= looked_up
    for field in ("drafts", "draft_tokens", "accepted_tokens"):
        assert sum(getattr(s, field) for s in parts.values()) == getattr(stats, field)
    text = Metrics(lambda: EngineStats(spec=stats.copy())).render().decode()
    for source, part in parts.items():
        assert (f'heron_spec_decode_accepted_tokens_by_source_total{{source="{source}"}} '
                f"{float(part.accepted_tokens)}") in text
    assert_no_leaks(engine)


@pytest.mark.parametrize("overrides", [
    {},
    {"engine.max_num_seqs": 2},  # requests join while others verify drafts
    {"engine.num_kv_blocks": 40, "engine.block_size": 4},  # preemption
    {"speculative.prompt_lookup": True, "engine.num_kv_blocks": 40, "engine.block_size": 4},
], ids=["one-batch", "staggered", "preempted", "lookup-first-preempted"])
def test_greedy_outputs_are_identical_with_mtp_drafts(tiny, overrides):
    path, _, _ = tiny
    prompts = PROMPTS[:6]
    prompts[3] = prompts[0] + prompts[3]  # a prefix-cache hit: the head starts mid-prompt
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             speculative=i % 3 != 2, n=2 if i == 4 else 1)
              for i in range(len(prompts))]

    def outputs(engine):
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", ids, p)
        done = run_to_end(engine)
        return [[o.token_ids for o in done[f"r{i}"].outputs] for i in range(len(prompts))]

    plain = outputs(make_engine(path, **overrides))
    engine = make_engine(path, **overrides, **MTP)
    assert outputs(engine) == plain
    stats = engine.spec_stats
    assert stats.acceptance_rate > 0.2, stats
    assert stats.accepted_at[2] > 0 and stats.draft_tokens > stats.accepted_tokens
    if overrides:  # the longer prompt was admitted after the first had cached its blocks
        assert engine.scheduler.prefix_hit_tokens > 0
    if "engine.num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    proposer = engine.proposer
    if "speculative.prompt_lookup" in overrides:
        assert not proposer.lookup.indexes and not proposer._looked_up
        proposer = proposer.model
    assert not proposer.caches  # every sequence's drafting state was dropped
    assert_no_leaks(engine)


@torch.no_grad()
def test_training_attends_as_drafting_does(tiny):
    """Each chained row of a `chain_mask` pass equals the module run the way drafting runs
    it: the verified pairs up to its chain's start, then its own chain. In float64, so that
    the two ways' different rounding (a trained head amplifies it past 1e-4 in float32)
    cannot hide a wrong mask."""
    _, hf, module = tiny
    module = copy.deepcopy(module).double()
    g = torch.Generator().manual_seed(4)
    m, depths = 7, 3
    hidden = torch.randn(1, m, hf.config.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(3, 300, (1, m + depths), generator=g)
    inputs, words, positions = [hidden], [], []
    for a in range(depths):
        words.append(tokens[:, 1 + a:1 + a + m])
        positions.append(torch.arange(a, a + m))
        out = module(torch.cat(inputs, 1), torch.cat(words, 1), torch.cat(positions),
                     chain_mask(a + 1, m))[:, a * m:]
        inputs.append(module.chained(out))
    for i in range(m):  # the chain that starts after position i
        h, t = hidden[:, :i + 1], tokens[:, 1:i + 2]
        for a in range(depths):
            last = module(h, t)[:, -1:]
            expected = out if a == depths - 1 else None
            if expected is not None:
                torch.testing.assert_close(last[0, 0], out[0, i], rtol=1e-10, atol=1e-10)
            h = torch.cat([h, module.chained(last)], 1)
            t = torch.cat([t, tokens[:, i + a + 2:i + a + 3]], 1)


def test_a_trained_head_beats_a_random_one(tmp_path, tiny):
    path, hf, _ = tiny
    torch.manual_seed(5)
    untrained = MtpModule(hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight)
    rates = {}
    for name, where in (("trained", path), ("random", with_head(tmp_path, tiny, untrained))):
        engine = make_engine(where, **MTP)
        engine.generate(PROMPTS[6:14],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        rates[name] = engine.spec_stats.acceptance_rate
    assert rates["trained"] > 0.4 and rates["trained"] > 3 * rates["random"], rates


def test_copy_prompts_ask_to_write_each_text_out_again_misspelt():
    text = "Every morning the baker opens the shop and arranges bread, rolls and cakes."
    prompts = copy_prompts([text] * 30 + ["  "], seed=0)
    assert len(prompts) == 30  # the blank answer asks for nothing
    bodies = []
    for p in prompts:
        lead = next(t.split("{}")[0] for t in COPY if p["content"].startswith(t.split("{}")[0]))
        bodies.append(p["content"][len(lead):])
    assert all(len(b.split(" ")) == len(text.split(" ")) for b in bodies)
    assert text in bodies and sum(b != text for b in bodies) > 10


def test_a_saved_head_loads_back_to_train_on(tiny):
    path, hf, trained = tiny
    engine = make_engine(path)
    loaded = load_module(path / "mtp.safetensors", hf.config, engine.runner.model)
    expected, got = trained.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert torch.equal(loaded.head, trained.head) and loaded.draft_ids is None
    assert loaded.hidden_layer is None
    assert all(p.requires_grad for p in loaded.layer.parameters())


def test_a_head_reading_a_middle_layer_saves_loads_and_checks_that_layer(tmp_path, tiny):
    path, hf, _ = tiny
    engine = make_engine(path)
    module = new_module(hf.config, engine.runner.model, None, hidden_layer=1)
    module.save(tmp_path / "h.safetensors", hf.config.num_hidden_layers)
    loaded = load_module(tmp_path / "h.safetensors", hf.config, engine.runner.model)
    assert loaded.hidden_layer == 1
    for layer in (0, 3):
        module.hidden_layer = layer
        where = with_head(tmp_path / str(layer), tiny, module)
        with pytest.raises(ValueError, match=f"hidden_layer {layer} is not a layer of the "
                                             "target's 1..2"):
            make_engine(where, **MTP)


@pytest.mark.parametrize("setting, expected", [
    ("auto", 3), ("final", None), ("2", 2),
    (4, None),  # the last layer's output is the final hidden state: no layer is written
    ("5", "the model has layers 1..4"), (0, "the model has layers 1..4"),
    ("last", "a layer number, 'auto' or 'final'")])
def test_train_mtp_hidden_layer_settings(setting, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            resolve_hidden_layer(setting, 4)
    else:
        assert resolve_hidden_layer(setting, 4) == expected


def test_agreement_is_the_first_drafts_acceptance(tiny):
    """`agreement`, measured offline on recorded samples, is what drafting in the engine
    gets for its first draft (there over the positions a step drafts for, so close, not
    equal), for the trained head and for a random one."""
    path, hf, module = tiny
    prompts, params = PROMPTS[6:14], SamplingParams(max_tokens=32, temperature=0.0)
    samples = generate_samples(make_engine(path, **{"prefix_cache.enabled": False}), prompts,
                               32)
    torch.manual_seed(5)
    untrained = MtpModule(hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight)
    offline = {"trained": agreement(module, samples), "random": agreement(untrained, samples)}
    assert offline["trained"] > 0.4 and offline["random"] < 0.1, offline
    engine = make_engine(path, **{**MTP, "speculative.num_speculative_tokens": 1})
    engine.generate(prompts, params)
    stats = engine.spec_stats
    assert abs(stats.accepted_at[0] / stats.drafts - offline["trained"]) < 0.1, offline


def test_a_checkpoint_without_an_mtp_head_is_refused(tmp_path):
    build_tiny("llama", tmp_path)
    with pytest.raises(ValueError, match="holds no MTP weights"):
        make_engine(tmp_path, **MTP)
    with pytest.raises(ValueError, match="does not exist"):
        make_engine(tmp_path, **MTP, **{"speculative.model": str(tmp_path / "nope")})



@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """A tiny Bamba (Mamba2 and attention layers) with a head trained the same way, its
    layer shaped like Bamba's attention layers."""
    import transformers

    from tests.hybrid_models import build_hybrid
    path = tmp_path_factory.mktemp("bamba-mtp")
    hf = build_hybrid("bamba", path)
    engine = make_engine(path, **{"prefix_cache.enabled": False})
    samples = generate_samples(engine, PROMPTS, max_tokens=40)
    c = hf.config
    shape = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=128,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings)
    torch.manual_seed(0)
    module = MtpModule(shape, hf.model.embed_tokens.weight, hf.lm_head.weight)
    train(module, samples, epochs=150, lr=1e-2, batch_size=8, depth=3)
    module.save(path / "mtp.safetensors", c.num_hidden_layers)
    return path, hf


def test_a_hybrids_hidden_states_are_transformers(bamba):
    """What the head reads from a hybrid model: its final hidden states, every row."""
    path, hf = bamba
    engine = make_engine(path, **MTP)
    rows = {}
    observe = engine.proposer.observe

    def record(seq, start, hidden):
        rows.update({(seq.request_id, start + i): r.clone() for i, r in enumerate(hidden)})
        observe(seq, start, hidden)

    engine.proposer.observe = record
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS[:3], params)
    for out, prompt in zip(outs, PROMPTS):
        tokens = prompt + out.outputs[0].token_ids[:-1]
        with torch.no_grad():
            expected = hf.model(torch.tensor([tokens])).last_hidden_state[0]
        got = torch.stack([rows[out.request_id, j] for j in range(len(tokens))])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", ["tiny", "bamba"])
def test_a_middle_layers_hidden_states_are_transformers(request, model):
    """What a head reading layer 1 (Bamba's: a Mamba layer) is trained on: that layer's
    output through the final norm, and for the teacher the final hidden states, every
    row, as transformers computes them."""
    path, hf = request.getfixturevalue(model)[:2]
    engine = make_engine(path, **{"prefix_cache.enabled": False, "engine.max_num_seqs": 2})
    samples = generate_samples(engine, PROMPTS[:3], 12, hidden_layer=1)
    assert len(samples) == 3
    for s in samples:
        tokens = s.tokens[:-1]
        torch.testing.assert_close(s.hidden, hf_hidden(hf, tokens, 1)[0], rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(s.final, hf_hidden(hf, tokens)[0], rtol=1e-4, atol=1e-4)
        assert s.teacher is s.final


@pytest.mark.parametrize("overrides", [
    {"engine.max_num_seqs": 2},
    {"engine.num_kv_blocks": 40, "engine.block_size": 4},
], ids=["staggered", "preempted"])
def test_a_hybrids_greedy_outputs_are_identical_with_mtp_drafts(bamba, overrides):
    path, _ = bamba
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             speculative=i % 3 != 2) for i in range(6)]
    plain = [o.outputs[0].token_ids for o in make_engine(path, **overrides).generate(
        PROMPTS[:6], params)]
    engine = make_engine(path, **overrides, **MTP)
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:6], params)] == plain
    stats = engine.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens > 0, stats
    if "engine.num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)
