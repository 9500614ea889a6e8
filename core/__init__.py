"""heron's core: engine, scheduler, pools, sampling, config and the plugin API.

Everything a model-family plugin needs is exported here and by `heron.core.ops` (the model
ops, with their CUDA kernels and the kernel launcher); plugins import nothing else.
"""

from heron.core.batch import AttentionMetadata, Batch, EncoderChunk
from heron.core.cache_spec import CacheSpec, CacheTensors, KVCacheSpec, StateSpec
from heron.core.checkpoint import load_safetensors
from heron.core.config import Config, ConfigError, EngineConfig, ModelConfig, load_config
from heron.core.engine import Engine
from heron.core.family import FamilySpec, LoadedModel, ModelInfo, ModelRunner
from heron.core.hookspecs import hookimpl, hookspec
from heron.core.plugins import PluginError, PluginManager
from heron.core.pooling import ScoreHead
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence, SequenceStatus
from heron.core.tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata", "Batch", "CacheSpec", "CacheTensors", "Config", "ConfigError",
    "EncoderChunk", "Engine", "EngineConfig", "FamilySpec", "KVCacheSpec", "LoadedModel", "ModelConfig", "ModelInfo",
    "ModelRunner", "PluginError", "PluginManager", "SamplingParams", "ScoreHead", "Sequence",
    "SequenceStatus", "StateSpec", "Tokenizer", "hookimpl", "hookspec", "load_config",
    "load_safetensors",
]
