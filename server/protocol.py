"""OpenAI (and vLLM) request bodies as msgspec Structs: decoding a body validates it.

Unknown fields are refused (a misspelt option must not be silently ignored). Fields that
clients commonly send and that change nothing here (``user``, ``metadata``, ``store``...)
are accepted and ignored. Fields that would change the answer but are not implemented
(``suffix``, ``functions``, ``best_of``...) are declared only so that `unsupported_field`
can refuse them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

# hard ceilings; the configured server.max_n / server.max_logprobs apply below them (admission)
from heron.core.config import MAX_LOGPROBS, MAX_N

NonNegInt = Annotated[int, Meta(ge=0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]  # int64, as vLLM
# vLLM's: lower runs first, with engine.scheduling_policy = "priority" (int32, as vLLM)
Priority = Annotated[int, Meta(ge=-2**31, le=2**31 - 1)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# NLLB language codes (``eng_Latn``): one for every input, or one per input
LanguageCodes = str | list[str]
NumBeams = Annotated[int, Meta(ge=1, le=64)]
# a hypothesis scores sum(logprobs) / length ** length_penalty: bounded so that the power
# stays a float at any length
LengthPenalty = Annotated[float, Meta(ge=-10.0, le=10.0)]
# most logit_bias entries in one request: each costs host work in every step of the request
MAX_LOGIT_BIAS = 1024
# beam search stops: as soon as num_beams hypotheses end (true), when the best running one
# cannot win any more (false), or by that test at the longest length ("never")
EarlyStopping = bool | Literal["never"]


class _Body(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchema(_Body, kw_only=True):
    """OpenAI's ``response_format.json_schema``; no ``schema``: any JSON value."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(_Body, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Body, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json: dict[str, Any] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None  # Lark
    json_object: bool | None = None


class SamplingFields(_Body, kw_only=True):
    """Fields shared by /v1/completions, /v1/chat/completions and /v1/responses."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: Annotated[int, Meta(ge=-1)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    allowed_token_ids: Annotated[list[NonNegInt], Meta(min_length=1)] | None = None
    bad_words: list[Annotated[str, Meta(min_length=1)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    # vLLM's: token ids of prompt and output in the response (unset: when there is no
    # tokenizer, whose text would be empty)
    return_token_ids: bool | None = None
    # prefix-cache isolation: only requests with the same salt share cached KV
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None
    # false: no speculative drafts for this request (outputs are the same either way)
    speculative: bool = True
    priority: Priority = 0
    # the output matches a JSON schema, a regex, ... (vLLM's, or OpenAI's response_format)
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # accepted and ignored: they do not change the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # token id (a string, as JSON keys are) -> bias added to its logit
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # refused by name unless equal to n (see `unsupported_field`)
    best_of: Annotated[int, Meta(ge=1)] | None = None

    def unsupported_field(self) -> str | None:
        """The first field set to something this server does not implement, or None."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None


class BeamSearchFields(SamplingFields, kw_only=True):
    """Completions' and chat's beam search, with transformers' ``generate`` semantics: the
    ``n`` best of ``num_beams`` hypotheses (vLLM's ``use_beam_search``: ``n`` beams, all
    returned)."""

    num_beams: NumBeams | None = None
    length_penalty: LengthPenalty | None = None
    early_stopping: EarlyStopping | None = None
    use_beam_search: bool = False


# vLLM's: keep each prompt's last k tokens (-1: as many as the model takes)
TruncatePromptTokens = Annotated[int, Meta(ge=-1)] | None
# vLLM's: with truncate_prompt_tokens, "right" keeps the first k tokens instead (unset: "left")
TruncationSide = Literal["left", "right"] | None


class CompletionRequest(BeamSearchFields, kw_only=True):
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists
    (checked by the handler: msgspec unions hold one array type at most)."""

    prompt: str | list[Any]
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    # vLLM's: false leaves out the special tokens (a BOS) the tokenizer adds to a text prompt
    add_special_tokens: bool = True
    max_tokens: NonNegInt | None = 16
    echo: bool = False
    logprobs: NumLogprobs | None = None
    # vLLM's: each prompt token's logprob and the k most likely in its place (not streamed)
    prompt_logprobs: NumLogprobs | None = None
    suffix: str | None = None
    # translation models only (then ``prompt`` is the source text)
    src_lang: LanguageCodes | None = None
    tgt_lang: LanguageCodes | None = None

    def unsupported_field(self) -> str | None:
        return "suffix" if self.suffix else super().unsupported_field()


class TranslationRequest(_Body, kw_only=True):
    """/v1/translations: ``input`` is one source text or several; ``src_lang`` and
    ``tgt_lang`` one code for all or one per input (unset: ``model.src_lang`` /
    ``model.tgt_lang``). Greedy unless ``temperature`` is set; ``n`` translations of each
    input (with beams, the ``n`` best hypotheses: ``n`` <= ``num_beams``)."""

    model: str | None = None
    input: str | list[str]
    src_lang: LanguageCodes | None = None
    tgt_lang: LanguageCodes | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    num_beams: NumBeams | None = None
    length_penalty: LengthPenalty | None = None
    early_stopping: EarlyStopping | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    min_tokens: NonNegInt = 0
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    seed: Seed | None = None
    user: str | None = None  # accepted and ignored


class ContentPart(_Body, kw_only=True):
    """One part of a message's content; only ``type == "text"`` is served."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class FunctionDefinition(_Body, kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body, kw_only=True):
    name: str


class NamedToolChoice(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body, kw_only=True):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallIn(_Body, kw_only=True):
    """A call an earlier assistant message made."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    # an earlier answer's thinking, as a reasoning parser returned it (vLLM's name; DeepSeek's)
    reasoning: str | None = None
    reasoning_content: str | None = None


def unsupported_part(messages: list[ChatMessage]) -> str | None:
    """The first content part that is not text (``messages[i].content[j].type``), or None."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text" or part.text is None:
                return f"messages[{i}].content[{j}].type"
    return None


class ChatCompletionRequest(BeamSearchFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # vLLM's: each prompt token's logprob and the k most likely in its place (not streamed)
    prompt_logprobs: NumLogprobs | None = None
    # vLLM extras for the chat template
    add_generation_prompt: bool = True
    # the answer continues the final message (an assistant's start, say); needs
    # add_generation_prompt false
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: true adds the tokenizer's special tokens (a BOS) before the rendered template
    add_special_tokens: bool = False
    # vLLM's: the template's `documents` (RAG templates read them; others ignore them)
    documents: list[dict[str, str]] | None = None
    # vLLM's: the rendered prompt in the response (streamed: in the first chunk)
    return_prompt_text: bool = False
    # vLLM's: an answer to a final assistant message starts with that message's text
    echo: bool = False
    # to the chat template as `reasoning_effort` (gpt-oss's reads it; most ignore it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: at most this many tokens of thinking, then </think> (needs a reasoning parser)
    thinking_token_budget: NonNegInt | None = None
    # accepted and ignored
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    safety_identifier: str | None = None
    tools: list[Tool] | None = None
    # unset: "auto" with tools, "none" without
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: "required" makes exactly one call
    # refused by name unless empty (see `unsupported_field`)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported_field(self) -> str | None:
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name):
                return name
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        for i, message in enumerate(self.messages):
            if message.role == "function":  # the legacy API; "tool" replaces it
                return f"messages[{i}].role"
            if message.function_call:
                return f"messages[{i}].function_call"
        return unsupported_part(self.messages) or super().unsupported_field()


class EmbeddingRequest(_Body, kw_only=True):
    """/v1/embeddings (embedding models): ``input`` is a text, a list of texts, a list of
    token ids or a list of such lists (checked by the handler, as a completion's
    ``prompt``); or, as vLLM takes it, chat ``messages`` rendered by the chat template
    (one input; exactly one of the two). ``dimensions``: the model's own width, or one its
    vectors may be shortened to (`Pooling.check_dimensions`)."""

    model: str | None = None
    input: str | list[Any] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # with messages, as in vLLM's: the template's settings
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    priority: Priority = 0
    user: str | None = None  # accepted and ignored


class ClassificationRequest(_Body, kw_only=True):
    """vLLM's /classify (classifiers): ``input`` as /v1/embeddings' (a text, texts, token
    ids or lists of them); each gets its labels' probabilities."""

    model: str | None = None
    input: str | list[Any]
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    priority: Priority = 0
    user: str | None = None  # accepted and ignored


class ScoreRequest(_Body, kw_only=True):
    """vLLM's /score (embedding models, cross-encoders): ``text_1`` and ``text_2`` are each a
    text or a list of texts (or, for an embedding model, token ids as a completion's
    ``prompt``); one ``text_1`` is scored against every ``text_2``, else they pair up in
    order (1:1, 1:N or N:N)."""

    model: str | None = None
    text_1: str | list[Any]
    text_2: str | list[Any]
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    priority: Priority = 0
    # vLLM's: the score template's variables (model.chat_template)
    chat_template_kwargs: dict[str, Any] | None = None


class RerankRequest(_Body, kw_only=True):
    """vLLM's (and Cohere's, Jina's) /rerank (embedding models, cross-encoders):
    ``documents`` ranked by their relevance to ``query``; ``top_n`` > 0 keeps that many of
    the most relevant."""

    model: str | None = None
    query: str | list[int]
    documents: list[Any]
    top_n: Annotated[int, Meta(ge=0)] = 0
    return_documents: bool = True
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: TruncationSide = None
    priority: Priority = 0
    # vLLM's: the score template's variables (model.chat_template)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body, kw_only=True):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages`` (with the chat request's
    template fields: ``tools``, ``chat_template_kwargs``...)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # unset: true for a prompt, false for messages (their template writes any BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # each token's vocabulary string too ("Ġthe" in byte-level vocabularies)
    return_token_strs: bool = False


class DetokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    tokens: list[NonNegInt]


AdapterName = Annotated[str, Meta(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(_Body, kw_only=True):
    """vLLM's /v1/load_lora_adapter: ``lora_path`` is a PEFT adapter directory."""

    lora_name: AdapterName
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(_Body, kw_only=True):
    lora_name: AdapterName
    lora_int_id: int | None = None  # vLLM's; accepted and ignored
