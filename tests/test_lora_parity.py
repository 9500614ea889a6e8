"""Multi-LoRA in heron vs `peft.PeftModel` on a tiny random Llama: prompt logits and greedy
tokens per adapter, adapters and the base model mixed in one batch, and more adapters than
slots."""

from __future__ import annotations

import pytest
import torch

from heron.core.lora import AdapterError
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import (LogitsRecorder, assert_no_leaks, eager_steps, make_engine,
                                relative_logit_error)
from tests.lora_models import (ATTENTION, MLP, STANDARD, build_adapter,
                               build_standard_adapters, greedy, peft_oracle)
from tests.tiny_models import build_tiny

pytest.importorskip("peft")

PROMPT_LENS = (5, 37, 70)
NUM_NEW = 16
# two more adapters for the slot-pressure test: five adapters, two slots
EXTRA = {"vo-r2": dict(r=2, alpha=4, targets=("v_proj", "o_proj")),
         "gate-up-r12": dict(r=12, alpha=6, targets=("gate_proj", "up_proj"))}
CHUNKED = {"engine.block_size": 16, "engine.max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model path, adapter paths, prompts, reference) where ``reference[(adapter, i)]`` is
    ``(prompt logits, greedy tokens)`` from PEFT (adapter None: the base model)."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny("llama", root / "base")
    paths = build_standard_adapters(base, root / "adapters")
    for seed, (name, kw) in enumerate(EXTRA.items(), start=len(paths)):
        paths[name] = root / "adapters" / name
        build_adapter(base, paths[name], seed=seed, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    reference = {}
    for adapter in [None, *paths]:
        model = base if adapter is None else peft_oracle(base, paths[adapter])
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt])).logits[0]
            reference[(adapter, i)] = (logits, greedy(model, prompt, NUM_NEW))
    return root / "base", paths, prompts, reference


def lora_engine(setup, names, **overrides):
    _, paths, _, _ = setup
    return make_engine(setup[0], **{"lora.adapters": {n: str(paths[n]) for n in names},
                                    "lora.max_rank": 16, **CHUNKED, **overrides})


def run_together(engine, jobs):
    """Submit every ``(request id, prompt, adapter)`` at once and step until all finish."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    for rid, prompt, adapter in jobs:
        engine.add_request(rid, prompt, params, adapter=adapter)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(done) == len(jobs)
    return done


def count_adapters_per_step(engine) -> list[int]:
    """Wraps the runner's forward; the returned list grows by the number of adapters in
    each step's batch."""
    counts, forward = [], eager_steps(engine).runner.forward

    def spy(batch):
        counts.append(len({group[0] for group in batch.lora_groups}))  # distinct slots
        return forward(batch)

    engine.runner.forward = spy
    return counts


def check(setup, jobs, done, recorder=None) -> dict:
    """Greedy tokens equal PEFT's; logits within 1e-4. The worst logit error per adapter."""
    _, _, prompts, reference = setup
    worst: dict = {}
    for rid, _, adapter in jobs:
        i = int(rid.rsplit("-", 1)[1])
        ref_logits, ref_tokens = reference[(adapter, i)]
        assert done[rid].outputs[0].token_ids == ref_tokens, rid
        if recorder is not None:
            mine = torch.stack([recorder.rows[(rid, p)] for p in range(len(prompts[i]))])
            worst[adapter] = max(worst.get(adapter, 0.0), (mine - ref_logits).abs().max().item())
    assert all(err <= 1e-4 for err in worst.values()), worst
    return worst


def test_adapters_change_the_model(setup):
    """Otherwise parity would prove nothing."""
    _, paths, prompts, reference = setup
    for adapter in paths:
        for i in range(len(prompts)):
            base_logits, adapter_logits = reference[(None, i)][0], reference[(adapter, i)][0]
            assert (base_logits - adapter_logits).abs().max() > 0.1, adapter


@pytest.mark.parametrize("adapter", sorted(STANDARD))
def test_each_adapter_matches_peft(setup, adapter):
    engine = lora_engine(setup, STANDARD)
    recorder = LogitsRecorder(engine)
    jobs = [(f"{adapter}-{i}", p, adapter) for i, p in enumerate(setup[2])]
    worst = check(setup, jobs, run_together(engine, jobs), recorder)
    print(f"max abs logit error {adapter}: {worst[adapter]:.2e}")
    assert_no_leaks(engine)


def test_base_and_three_adapters_share_one_batch(setup):
    engine = lora_engine(setup, STANDARD, **{"engine.max_num_batched_tokens": 512})
    recorder = LogitsRecorder(engine)
    adapters_per_step = count_adapters_per_step(engine)
    jobs = [(f"{a or 'base'}-{i}", p, a) for a in [None, *STANDARD]
            for i, p in enumerate(setup[2])]
    worst = check(setup, jobs, run_together(engine, jobs), recorder)
    print("max abs logit error per adapter:", {k: f"{v:.2e}" for k, v in worst.items()})
    assert max(adapters_per_step) == len(STANDARD)  # every adapter in one step, base rows too
    assert engine.adapter_pool.num_referenced == 0
    assert_no_leaks(engine)


def test_five_adapters_through_two_slots(setup):
    names = [*STANDARD, *EXTRA]
    engine = lora_engine(setup, names, **{"lora.max_loras": 2})
    pool = engine.adapter_pool
    start = (pool.num_free_slots, pool.num_referenced)
    adapters_per_step = count_adapters_per_step(engine)
    jobs = [(f"{a}-{i}", p, a) for a in names for i, p in enumerate(setup[2])]
    check(setup, jobs, run_together(engine, jobs))
    assert max(adapters_per_step) == 2  # never more adapters in a step than slots
    assert pool.num_referenced == 0
    assert all(pool.refcount(key) == 0 for key in map(engine.lora.key, names))
    assert_no_leaks(engine)
    for name in names:  # unloading every adapter frees every slot
        engine.remove_adapter(name)
    assert (pool.num_free_slots, pool.num_referenced) == start


def test_adapter_added_at_run_time(setup):
    engine = make_engine(setup[0], **{"lora.allow_runtime_updates": True, "lora.max_rank": 16})
    with pytest.raises(AdapterError, match="adapter 'nowhere': .* is not a directory"):
        engine.add_adapter("nowhere", str(setup[0] / "no-such-adapter"))
    engine.add_adapter("mlp-r8", str(setup[1]["mlp-r8"]))
    jobs = [(f"mlp-r8-{i}", p, "mlp-r8") for i, p in enumerate(setup[2])]
    check(setup, jobs, run_together(engine, jobs))
    assert_no_leaks(engine)


def test_smollm2_gguf_adapter_matches_peft(default_gguf_path, tmp_path):
    """The real model's GGUF q/k rows are un-permuted on load, so PEFT adapters trained on
    the Hugging Face layout apply to it unchanged."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(default_gguf_path.parent, dtype=torch.float32,
                                                gguf_file=default_gguf_path.name).eval()
    oracle = build_adapter(base, tmp_path / "all-r8", r=8, alpha=16, targets=ATTENTION + MLP,
                           std=0.02)
    engine = make_engine(default_gguf_path, **{"lora.adapters": {"all": str(tmp_path / "all-r8")},
                                               "engine.max_num_batched_tokens": 64})
    recorder = LogitsRecorder(engine)
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe."}]))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    engine.add_request("gguf", prompt, params, adapter="all")
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    with torch.no_grad():
        ref = oracle(input_ids=torch.tensor([prompt])).logits[0]
        base_ref = base(input_ids=torch.tensor([prompt])).logits[0]
    mine = torch.stack([recorder.rows[("gguf", p)] for p in range(len(prompt))])
    assert (ref - base_ref).abs().max() > 0.1  # the adapter matters
    worst = relative_logit_error(mine, ref)
    print(f"max logit error SmolLM2 all-r8, relative to the largest logit: {worst:.2e}")
    assert worst <= 1e-5
    assert done["gguf"].outputs[0].token_ids == greedy(oracle, prompt, NUM_NEW)


def test_a_bad_adapter_at_start_up_is_skipped_and_named(setup, tmp_path, caplog):
    _, paths, _, _ = setup
    good = next(iter(paths))
    with caplog.at_level("ERROR", logger="heron.core.engine"):
        engine = make_engine(setup[0], **{
            "lora.adapters": {good: str(paths[good]), "missing": str(tmp_path / "nope")},
            "lora.max_rank": 16})
    assert set(engine.adapters) == {good}
    assert any("'missing'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="unknown adapter 'missing'"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2), adapter="missing")
