"""Helpers for tests that drive a real Engine."""

from __future__ import annotations

import itertools

import torch

from heron.core.config import Config, load_config
from heron.core.engine import Engine
from heron.core.outputs import RequestOutput


def engine_config(path, **overrides) -> Config:
    """The model at ``path`` in fp32 on the CPU, with ``overrides`` (dotted keys)."""
    return load_config(None, {"model.path": str(path), "model.dtype": "float32",
                              "model.device": "cpu", **overrides})


def make_engine(path, **overrides) -> Engine:
    return Engine(engine_config(path, **overrides))


def eager_steps(engine: Engine) -> Engine:
    """``engine`` with every step through ``engine.runner.forward``, for a test that wraps
    it: a replayed decode step (`heron.core.cpu_graphs`) calls no forward."""
    engine.graphs = None
    return engine


class LogitsRecorder:
    """Wraps a runner's forward (calling through) and keeps each logits row by
    ``(request_id, position)`` of the token whose row it is."""

    def __init__(self, engine: Engine) -> None:
        eager_steps(engine)
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self._forward = engine.runner.forward
        engine.runner.forward = self.forward

    def forward(self, batch):
        logits = self._forward(batch)
        qsl = batch.attn.query_start_loc.tolist()
        owner = {}
        for i, seq in enumerate(batch.seqs):
            for r in range(qsl[i], qsl[i + 1]):
                owner[r] = seq.request_id
        positions = batch.positions.tolist()
        for j, r in enumerate(batch.logits_indices.tolist()):
            self.rows[(owner[r], positions[r])] = logits[j].clone()
        return logits


def assert_no_leaks(engine: Engine) -> None:
    """Idle engine: no request left, every block either free or held by the cache alone."""
    pool = engine.block_pool
    cached = engine.prefix_cache.num_cached_blocks if engine.prefix_cache is not None else 0
    assert not engine.has_unfinished() and engine.num_requests == 0
    assert engine.num_blocks_in_use == 0
    assert pool.num_used_blocks == pool.num_evictable_blocks == cached
    assert engine.num_host_blocks_in_use == 0


def run_one(engine: Engine, prompt, params, **kw):
    """Add one request (``kw``: tenant, adapter) and step until it finishes; its output."""
    request_id = f"one-{next(_ids)}"
    engine.add_request(request_id, prompt, params, **kw)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


_ids = itertools.count()


def run_to_end(engine: Engine) -> dict[str, RequestOutput]:
    """Step until no request is left; the final output of each, by request id."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def relative_logit_error(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference logit: a real model's logits
    reach ~30, where 30 layers of fp32 sums in another order differ by ~1e-4."""
    return ((mine - ref).abs().max() / ref.abs().max()).item()


def assert_greedy_logits_match(engine: Engine, model, prompt: list[int],
                               max_tokens: int = 6) -> None:
    """A greedy run of ``prompt`` on ``engine``: its logits at every position (the
    prompt's, then each new token's) match transformers' ``model`` on the same tokens."""
    from heron.core.sampling_params import SamplingParams
    recorder = LogitsRecorder(engine)
    out, = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True, prompt_logprobs=0))
    ids = prompt + out.outputs[0].token_ids[:-1]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    mine = torch.stack([recorder.rows[(out.request_id, pos)] for pos in range(len(ids))])
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)
