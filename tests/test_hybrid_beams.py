"""Beam search on a hybrid (Mamba2 + attention) model: forked beams copy their parent's SSM
state slot (`ModelRunner.fork_state`) and share its KV blocks copy-on-write. The reference
steps the same `BeamSearch` on transformers' logits of every beam's whole sequence, run
from scratch each step, so no state is forked there at all."""

from __future__ import annotations

import torch

from heron.core.beam_search import BeamSearch
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.hybrid_models import build_hybrid

PROMPTS = [[5, 9, 11, 3, 7, 2, 14], [21, 4, 4, 8], [3, 30, 12, 6, 19, 25, 1, 10, 17, 2, 9]]


@torch.no_grad()
def reference(model, prompt: list[int], num_beams: int, max_tokens: int):
    search = BeamSearch(num_beams, max_tokens, (), num_return=2)
    beams = [prompt]
    while True:
        logits = model(torch.tensor(beams)).logits[:, -1]
        pairs = search.step(logits)
        if search.done:
            return search.results()
        beams = [beams[p] + [t] for p, t in pairs]


def test_hybrid_beams_match_beam_search_over_transformers(tmp_path):
    model = build_hybrid("bamba", tmp_path)
    # a block size of 4 puts fork points inside and at the edges of blocks
    engine = make_engine(tmp_path, **{"engine.block_size": 4, "engine.max_num_seqs": 12})
    params = SamplingParams(num_beams=3, n=2, max_tokens=9, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    done = run_to_end(engine)
    for i, prompt in enumerate(PROMPTS):
        want = reference(model, prompt, 3, 9)
        got = [(list(o.token_ids), o.score) for o in done[f"r{i}"].outputs]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want], i
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4, i
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)
