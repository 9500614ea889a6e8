"""Checkpoint loading: sharded safetensors with an index load the same model."""

from __future__ import annotations

import torch

from heron.core.sampling_params import SamplingParams
from heron.core.checkpoint import safetensors_files
from tests.engine_utils import LogitsRecorder, make_engine
from tests.tiny_models import build_tiny


def test_sharded_checkpoint_matches_transformers(tmp_path):
    model = build_tiny("qwen2", tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(safetensors_files(tmp_path / "sharded")) > 1
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    engine = make_engine(tmp_path / "sharded")
    recorder = LogitsRecorder(engine)
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert (recorder.rows[(out.request_id, len(prompt) - 1)] - expected).abs().max() <= 1e-4
    assert out.outputs[0].token_ids == [int(expected.argmax())]
