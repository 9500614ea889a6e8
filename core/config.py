"""Configuration: TOML files decoded into msgspec Structs, with ``--set`` style overrides.

Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the file and
the key.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration problem, with the file and key it came from in the message."""


_SECRET_KEYS = frozenset({"api_keys", "tenants"})  # never echoed in errors, reprs or `heron config`

# Hard ceilings of the per-request limits: the protocol refuses more whatever the config says
# (server.max_n and server.max_logprobs are the limits that normally apply, below these).
MAX_N = 128
MAX_LOGPROBS = 1024
# the formats `heron.server.tool_parsers` reads tool calls in (server.tool_call_parser)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")

#: An NLLB-200 language code (``eng_Latn``, ``zho_Hant``): ISO 639-3 language, ISO 15924 script.
LANGUAGE_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def __post_init__(self) -> None:
        for name in self.__struct_fields__:  # TOML and --set take inf and nan as floats
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"`{name}` must be a finite number (got {value!r})")
        for name, ok, why in self._checks():
            if not ok:
                got = "" if name in _SECRET_KEYS else f" (got {getattr(self, name)!r})"
                raise ValueError(f"`{name}` {why}{got}")

    def _checks(self) -> tuple[tuple[str, bool, str], ...]:
        return ()

    def __repr__(self) -> str:  # NOTE: secrets must never reach a log line or a traceback
        fields = (f"{k}={_masked(k, getattr(self, k))}" for k in self.__struct_fields__)
        return f"{type(self).__name__}({', '.join(fields)})"


def _masked(key: str, value: Any) -> str:
    return f"<{len(value)} hidden>" if key in _SECRET_KEYS and value else repr(value)


class ModelConfig(_Section):
    path: str | None = None
    family: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = None
    num_threads: int | None = None
    # translation models: the language of requests that name none
    src_lang: str | None = None
    tgt_lang: str | None = None
    # what the model serves: "generate" (text), "embed" (one vector per input, pooled
    # from its hidden states) or "classify" (its labels' probabilities, by its score head);
    # auto: embed for a sentence-transformers checkpoint or a bare model without an LM
    # head, classify for a sequence-classification one (`heron.core.pooling`)
    task: Literal["auto", "generate", "embed", "classify"] = "auto"
    # a causal LM classifying by some of its LM head's rows (vLLM's `classifier_from_token`):
    # one token, the sigmoid of its logit; two, [no, yes], the probability of the second
    # against the first (Qwen3-Reranker's); more, the softmax over their logits
    classifier_from_tokens: list[str] | None = None
    # the chat template in place of the tokenizer's (vLLM's --chat-template): a file, or
    # the template itself; for a cross-encoder, /score and /rerank render each pair through
    # it as two messages, roles "query" and "document" (vLLM's score templates)
    chat_template: str | None = None
    # how an embedding pools its tokens' hidden states; auto: as the checkpoint's
    # sentence-transformers Pooling module says, else the family's default ("last" for a
    # decoder, "cls" for an encoder: `ModelRunner.default_pooling`)
    pooling: Literal["auto", "last", "mean", "cls"] = "auto"
    # L2-normalize embeddings; unset: as the checkpoint's sentence-transformers modules
    # say (a Normalize module), else true
    normalize: bool | None = None
    # the widths a request's `dimensions` may shorten an embedding to (its first values,
    # normalized again), for a model trained to allow it (Matryoshka): a list, or true for
    # any; unset: as the checkpoint's config.json says (vLLM's `matryoshka_dimensions` or
    # `is_matryoshka`), else none
    matryoshka_dimensions: list[int] | bool | None = None
    # a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q3_K-Q6_K / IQ4_NL / IQ4_XS projection
    # weights stay quantized on the CPU in float32 (`heron.core.ops.quantized`); "int8": and
    # batches of up to 16 rows (4 for Q5, K-quants and IQ4_XS) are quantized to 8 bits a value
    # to multiply them in integers (not exact); false: every weight is dequantized at load
    keep_quantized: bool | Literal["int8"] = True

    def _checks(self):
        return (("max_model_len", self.max_model_len is None or self.max_model_len >= 1,
                 "must be >= 1"),
                ("classifier_from_tokens", self.classifier_from_tokens != [],
                 "must name at least one token"),
                ("chat_template", self.chat_template != "",
                 "must name a template file or hold a template"),
                ("num_threads", self.num_threads is None or self.num_threads >= 1,
                 "must be >= 1"),
                ("matryoshka_dimensions", not isinstance(self.matryoshka_dimensions, list)
                 or (bool(self.matryoshka_dimensions)
                     and min(self.matryoshka_dimensions) >= 1),
                 "must be true, false or a non-empty list of widths >= 1"),
                *((name, code is None or bool(LANGUAGE_CODE.fullmatch(code)),
                   "must be an NLLB language code like `eng_Latn`")
                  for name, code in (("src_lang", self.src_lang), ("tgt_lang", self.tgt_lang))))


class EngineConfig(_Section):
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    cuda_graphs: bool = True
    cpu_graphs: bool = True
    cpu_kernels: bool = True
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    preemption: Literal["recompute", "swap"] = "recompute"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    swap_space_gb: float = 4.0
    num_swap_blocks: int | None = None

    def _checks(self):
        return (
            ("block_size", 1 <= self.block_size <= 1024, "must be in 1..1024"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             "must be >= 1"),
            ("kv_cache_memory_gb", self.kv_cache_memory_gb > 0, "must be > 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("swap_space_gb", self.swap_space_gb > 0, "must be > 0"),
            ("num_swap_blocks", self.num_swap_blocks is None or self.num_swap_blocks >= 1,
             "must be >= 1"),
        )


class PrefixCacheConfig(_Section):
    enabled: bool = True
    eviction: Literal["lru", "flop_aware"] = "lru"
    snapshot_admission: Literal["marconi", "every_block"] = "marconi"
    snapshot_memory_gb: float = 1.0
    num_snapshots: int | None = None
    flop_weight: float = 1.0

    def _checks(self):
        return (
            ("snapshot_memory_gb", self.snapshot_memory_gb > 0, "must be > 0"),
            ("num_snapshots", self.num_snapshots is None or self.num_snapshots >= 1,
             "must be >= 1"),
            ("flop_weight", self.flop_weight >= 0, "must be >= 0"),
        )


_TENANT_NAME = re.compile(r"[\w.-]{1,64}")


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: list[str] = []
    tenants: dict[str, list[str]] = {}
    admin_tenants: list[str] = []
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262144
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id; 0: none

    @property
    def key_tenants(self) -> list[tuple[str, str]]:
        """(key, tenant) for every accepted key: a `tenants` key belongs to its named tenant;
        an `api_keys` key is a tenant of its own, named by its place in the list,
        ``api_keys[i]`` (nothing derived from the key: names reach /metrics, which is open;
        no tenant name has brackets)."""
        return [*((k, f"api_keys[{i}]") for i, k in enumerate(self.api_keys)),
                *((k, name) for name, keys in self.tenants.items() for k in keys)]

    def _checks(self):
        return (
            ("host", bool(self.host), "must not be empty"),
            ("port", 0 <= self.port <= 65535, "must be in 0..65535"),
            ("served_model_name", self.served_model_name is None or bool(self.served_model_name),
             "must not be empty"),
            ("api_keys", all(k.strip() for k in self.api_keys), "must not contain an empty key"),
            ("tenants", all(_TENANT_NAME.fullmatch(n) for n in self.tenants),
             "names must be 1-64 letters, digits, '.', '_' or '-'"),
            ("tenants", all(k.strip() for keys in self.tenants.values() for k in keys),
             "must not contain an empty key"),
            ("tenants", len({k for k, _ in self.key_tenants}) == len(self.key_tenants),
             "must not repeat a key (in `tenants` or `api_keys`)"),
            ("admin_tenants",
             set(self.admin_tenants) <= {*self.tenants, *(t for _, t in self.key_tenants)},
             "must name tenants of `tenants` (or `api_keys[i]`)"),
            ("max_body_bytes", self.max_body_bytes >= 1024, "must be >= 1024"),
            ("max_waiting_requests", self.max_waiting_requests >= 1, "must be >= 1"),
            ("max_waiting_tokens", self.max_waiting_tokens >= 1, "must be >= 1"),
            ("max_n", 1 <= self.max_n <= MAX_N, f"must be in 1..{MAX_N}"),
            ("max_logprobs", 0 <= self.max_logprobs <= MAX_LOGPROBS,
             f"must be in 0..{MAX_LOGPROBS}"),
            ("max_stop_sequences", self.max_stop_sequences >= 0, "must be >= 0"),
            ("max_stop_length", self.max_stop_length >= 1, "must be >= 1"),
            ("request_timeout_s", self.request_timeout_s is None or self.request_timeout_s > 0,
             "must be > 0"),
            ("drain_timeout_s", self.drain_timeout_s >= 0, "must be >= 0"),
            ("max_stored_responses", self.max_stored_responses >= 0, "must be >= 0"),
            ("tool_call_parser", self.tool_call_parser in ("", *TOOL_CALL_PARSERS),
             f'must be "" or one of {", ".join(map(repr, TOOL_CALL_PARSERS))}'),
            ("reasoning_parser", self.reasoning_parser in ("", "deepseek_r1", "qwen3"),
             'must be "", "deepseek_r1" or "qwen3"'),
        )


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    log_requests: bool = True


class LoraConfig(_Section):
    adapters: dict[str, str] = {}
    max_loras: int = 4
    max_rank: int = 16
    allow_runtime_updates: bool = False
    allowed_dirs: list[str] = []

    def _checks(self):
        return (
            ("adapters", all(n.strip() for n in self.adapters), "must not have an empty name"),
            ("max_loras", self.max_loras >= 1, "must be >= 1"),
            ("max_rank", 1 <= self.max_rank <= 1024, "must be in 1..1024"),
        )


class SpeculativeConfig(_Section):
    """``method``: a registered proposer (built in: ``"ngram"``, prompt lookup; ``"mtp"``,
    a multi-token-prediction head); "" is off. ``model``: where ``mtp`` finds the head's
    weights ("" = the model's own checkpoint). ``confidence_threshold``: ``mtp`` stops
    drafting for a sequence once its chain's probability (the product of the drafts'
    probabilities under the head) would fall below it. ``draft_dtype``: the dtype of the
    ``mtp`` head's projections ("auto": the model's); its activations stay in the model's.
    ``disable_by_batch_size``: no drafts in a step with more running sequences than this
    (0: no limit). ``prompt_lookup``: with another method, a sequence whose last n-gram
    occurred before drafts by prompt lookup, and only the others by the method.
    ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram sizes ``ngram`` (and
    ``prompt_lookup``) match. ``prefix_store_mb``: memory for ``mtp``'s K/V of prompt
    prefixes, which sequences that start past a prefix-cache hit read (0: none)."""

    method: str = ""
    model: str = ""
    num_speculative_tokens: int = 3
    confidence_threshold: float = 0.0
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    disable_by_batch_size: int = 0
    prompt_lookup: bool = False
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    prefix_store_mb: float = 64.0

    def _checks(self):
        return (
            ("num_speculative_tokens", 1 <= self.num_speculative_tokens <= 16,
             "must be in 1..16"),
            ("confidence_threshold", 0.0 <= self.confidence_threshold < 1.0,
             "must be in [0, 1)"),
            ("disable_by_batch_size", self.disable_by_batch_size >= 0, "must be >= 0"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             "must be >= prompt_lookup_min"),
            ("prefix_store_mb", self.prefix_store_mb >= 0, "must be >= 0"),
        )


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    prefix_cache: PrefixCacheConfig = msgspec.field(default_factory=PrefixCacheConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"--set {dotted}: `{part}` is not a section")
    tree[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"section.key=value"`` → ``("section.key", value)``; the value is a TOML literal,
    and a bare word that is not valid TOML is taken as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_config(config: Config, *,
                hide: tuple[str, ...] = ("server.api_keys", "server.tenants")) -> str:
    """The config as TOML that `load_config` reads back to an equal Config (but for the
    keys named in ``hide``, which are written masked, commented out). Unset (None) keys are
    written commented out too."""
    lines: list[str] = []
    for section in config.__struct_fields__:
        values = getattr(config, section)
        lines.append(f"[{section}]")
        for key in values.__struct_fields__:
            value = getattr(values, key)
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif f"{section}.{key}" in hide and value:
                lines.append(f"# {key} = ({len(value)} hidden)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] = ()) -> Config:
    """Read ``path`` (or the defaults when None), apply overrides, validate, return a Config."""
    source = str(path) if path is not None else "<defaults>"
    try:
        tree = tomllib.loads(Path(path).read_text()) if path is not None else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    items = list(overrides.items() if isinstance(overrides, dict)
                 else map(parse_override, overrides))
    for key, value in items:
        _set_dotted(tree, key, value)
    if items:  # a bad value may come from either
        source += " with the overrides " + ", ".join(key for key, _ in items)
    try:
        return msgspec.convert(tree, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
