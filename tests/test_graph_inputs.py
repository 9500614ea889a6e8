"""What a captured decode graph replays, run eagerly on CPU.

`heron.core.cuda_graphs.StaticDecodeInputs` is where a graph's inputs live; CUDA replays a
family's forward on its static, padded batch. Here every decode step of a real engine run
also goes through that batch, on a copy of the cache: it must give the step's logits, KV
and states, padding rows must change nothing, and a batch of padding alone (what a capture
warms up on) must keep nothing. The capture itself needs a GPU (tests/gpu).
"""

from __future__ import annotations

import pytest
import torch

from heron.core.cuda_graphs import StaticDecodeInputs
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import eager_steps, make_engine, run_to_end
from tests.hybrid_models import build_hybrid
from tests.lora_models import build_standard_adapters
from tests.tiny_models import build_tiny

PROMPT_LENS = (3, 17, 9, 30, 12)  # five sequences: padded to 8, then fewer as they finish


class StaticReplay:
    """Wraps an engine's forward; checks each decode step that fits a graph, then runs it
    for real. ``keys``: the graph keys of the steps checked; ``refused``: steps the family
    would not replay, with whether their static run differed."""

    def __init__(self, engine) -> None:
        self.engine, self.runner = eager_steps(engine), engine.runner
        self.inputs = StaticDecodeInputs(
            max_num_seqs=engine.config.engine.max_num_seqs,
            max_context_len=engine.max_model_len,
            block_size=engine.config.engine.block_size, device=torch.device("cpu"))
        self.forward = self.runner.forward
        self.runner.forward = self
        self.keys: list[tuple[int, int, bool]] = []
        self.refused: list[bool] = []
        self.errors: list[AssertionError] = []

    def _cache(self) -> list[torch.Tensor]:
        cache = self.engine.cache
        return [t for t in (cache.kv, *cache.states.values()) if t is not None]

    def __call__(self, batch):
        try:
            return self._check(batch)
        except AssertionError as e:  # the engine fails the step's requests and goes on
            self.errors.append(e)
            raise

    def _check(self, batch):
        if not self.inputs.fits(batch):
            return self.forward(batch)
        num = batch.attn.num_seqs
        before = [t.clone() for t in self._cache()]
        key = self.inputs.load(batch)
        self.forward(self.inputs.batch(*key, padding=True))
        for t, b in zip(self._cache(), before):
            assert torch.equal(t, b), "a batch of padding changed the cache"
        static = self.forward(self.inputs.batch(*key))[:num].clone()
        replayed = [t.clone() for t in self._cache()]
        for t, b in zip(self._cache(), before):
            t.copy_(b)
        logits = self.forward(batch)
        if not self.runner.can_replay(batch):
            self.refused.append(not torch.allclose(static, logits, atol=1e-5, rtol=1e-5))
            return logits
        self.keys.append(key)
        torch.testing.assert_close(static, logits, atol=1e-5, rtol=1e-5)
        for t, r in zip(self._cache(), replayed):
            torch.testing.assert_close(r, t, atol=1e-5, rtol=1e-5)  # padding rows included
        return logits


def _run(path, lens=PROMPT_LENS, adapters=(), **overrides):
    # the static batch is a CUDA graph's, whose attention is never the CPU kernel: both
    # runs take the torch ops, so they differ by the batch alone
    engine = make_engine(path, **{"engine.block_size": 8, "engine.max_num_seqs": 8,
                                  "engine.num_kv_blocks": 64,
                                  "engine.max_num_batched_tokens": 64,
                                  "engine.cpu_kernels": False, **overrides})
    replay = StaticReplay(engine)
    g = torch.Generator().manual_seed(4)
    for i, n in enumerate(lens):
        prompt = torch.randint(3, 250, (n,), generator=g).tolist()
        params = SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params,
                           adapter=adapters[i % len(adapters)] if adapters else None)
    outs = run_to_end(engine)
    assert not replay.errors, replay.errors[0]
    assert [o.outputs[0].finish_reason for o in outs.values()] == ["length"] * len(lens)
    assert engine.num_blocks_in_use == 0
    assert replay.keys, "no decode step was checked"
    return engine, replay


def _assert_padding_seen(replay) -> None:
    sizes = {key[0] for key in replay.keys}
    assert 8 in sizes and len(sizes) > 1, f"graph sizes {sizes}: padding not exercised"


@pytest.mark.parametrize("kind, build", [
    ("llama", build_tiny), ("qwen3", build_tiny),
    # Mamba2 states in slots: padding rows (slot -1) read and write none
    *((kind, build_hybrid) for kind in ("mamba2", "bamba", "falcon_h1",
                                        "granitemoehybrid-dense-nope"))])
def test_static_batch_matches(kind, build, tmp_path):
    build(kind, tmp_path)
    engine, replay = _run(tmp_path)
    assert engine.runner.supports_cuda_graphs
    _assert_padding_seen(replay)


def test_lora_rows_in_the_static_batch(tmp_path):
    """Two adapters and the base model in one decode batch: the static batch carries the
    rows' adapter slots alone (no host-side segments), padding rows none."""
    model = build_tiny("llama", tmp_path / "base")
    adapters = build_standard_adapters(model, tmp_path)
    names = [*list(adapters)[:2], None]
    _, replay = _run(tmp_path / "base", adapters=names,
                     **{"lora.adapters": {n: str(p) for n, p in adapters.items()}})
    assert all(key[2] for key in replay.keys), "a step with adapter rows lost them"
    _assert_padding_seen(replay)


def test_prompt_rows_are_not_replayed(tmp_path):
    """Nemotron-H clamps a prompt row's dt, which the static batch (no host-side sequences)
    does not do: a decode-only step holding a one-token prompt chunk (a 9-token prompt
    over an 8-token budget) must run eagerly, and would differ if it did not."""
    build_hybrid("nemotron_h-dense-dt-floor", tmp_path)
    engine, replay = _run(tmp_path, lens=(9,), **{"engine.max_num_batched_tokens": 8})
    assert engine.runner.supports_cuda_graphs
    assert replay.refused == [True], replay.refused


def test_moe_hybrid_does_not_capture(tmp_path):
    build_hybrid("nemotron_h", tmp_path)
    assert not make_engine(tmp_path).runner.supports_cuda_graphs
