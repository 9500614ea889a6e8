"""Tiny random-weight models built from transformers configs (no downloads): decoders, and
BERT-style encoders (`build_tiny_encoder`)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# YaRN as Qwen's long-context recipe adds it (beta defaults); the parity prompts run past
# the original context
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64}

# Granite's multipliers: granite-3.3-8b's for the embeddings and residuals; for attention
# one that suits a tiny head
GRANITE = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.09}

# OLMo 3's rope per layer type: YaRN on its full layers only (and here, another base for the
# windowed ones)
OLMO3 = {"layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 256,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                             "full_attention": YARN_ROPE}}

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "llama3-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                    {"rope_parameters": LLAMA3_ROPE}),
    "llama-tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                   {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 32}),
    "qwen3-yarn": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
                   {"head_dim": 32, "rope_parameters": YARN_ROPE,
                    "max_position_embeddings": 256}),
    # a logits divisor smaller than granite's 16 keeps the tiny model's logits past 1
    "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig,
                {**GRANITE, "logits_scaling": 4.0}),
    # OLMo 2's norms after attention and MLP, q/k norms over all heads
    "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config, {}),
    # OLMo 3's: and a rope per layer type
    "olmo3": (transformers.Olmo3ForCausalLM, transformers.Olmo3Config, OLMO3),
    # Phi-3's q/k/v and gate/up fused; half of each head rotating (Phi-4-mini's is 3/4)
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config,
             {"partial_rotary_factor": 0.5}),
    # SmolLM3's NoPE layers come every fourth; here the second of two
    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config,
                {"no_rope_layers": [1, 0]}),
    # served by the heron-gpt2 plugin (plugin_template/), installed by `make test`
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config, {"n_inner": 128}),
}

# the same architectures saved without their LM head, as embedding models are (the
# transformer family embeds them: tests/test_embeddings.py)
BARE = {
    "llama-bare": (transformers.LlamaModel, transformers.LlamaConfig, {}),
    "mistral-bare": (transformers.MistralModel, transformers.MistralConfig, {}),
    "qwen2-bare": (transformers.Qwen2Model, transformers.Qwen2Config, {}),
    "qwen3-bare": (transformers.Qwen3Model, transformers.Qwen3Config, {"head_dim": 32}),
    "granite-bare": (transformers.GraniteModel, transformers.GraniteConfig, GRANITE),
    "olmo2-bare": (transformers.Olmo2Model, transformers.Olmo2Config, {}),
    "olmo3-bare": (transformers.Olmo3Model, transformers.Olmo3Config, OLMO3),
    "phi3-bare": (transformers.Phi3Model, transformers.Phi3Config,
                  {"partial_rotary_factor": 0.5}),
    "smollm3-bare": (transformers.SmolLM3Model, transformers.SmolLM3Config,
                     {"no_rope_layers": [1, 0]}),
}

# ... and with a score head in its place, as classifiers and cross-encoders are (the
# transformer family classifies with them: tests/test_classify.py)
CLASSIFIERS = {
    "llama-cls": (transformers.LlamaForSequenceClassification, transformers.LlamaConfig,
                  {"num_labels": 3, "id2label": {0: "neg", 1: "neutral", 2: "pos"}}),
    "mistral-cls": (transformers.MistralForSequenceClassification, transformers.MistralConfig,
                    {"num_labels": 2}),
    "qwen2-cls": (transformers.Qwen2ForSequenceClassification, transformers.Qwen2Config,
                  {"num_labels": 1}),
    "qwen3-cls": (transformers.Qwen3ForSequenceClassification, transformers.Qwen3Config,
                  {"head_dim": 32, "num_labels": 1}),
    "olmo2-cls": (transformers.Olmo2ForSequenceClassification, transformers.Olmo2Config,
                  {"num_labels": 1}),
    "olmo3-cls": (transformers.Olmo3ForSequenceClassification, transformers.Olmo3Config,
                  {**OLMO3, "num_labels": 1}),
    "phi3-cls": (transformers.Phi3ForSequenceClassification, transformers.Phi3Config,
                 {"partial_rotary_factor": 0.5, "num_labels": 1}),
    "smollm3-cls": (transformers.SmolLM3ForSequenceClassification, transformers.SmolLM3Config,
                    {"no_rope_layers": [1, 0], "num_labels": 2}),
}

ENCODER_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
_ROBERTA = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                max_position_embeddings=130)  # positions from pad + 1: 128 tokens

_MODERNBERT = dict(num_hidden_layers=3, global_attn_every_n_layers=3, local_attention=8,
                   max_position_embeddings=8192, pad_token_id=0, cls_token_id=2,
                   sep_token_id=3, bos_token_id=None, eos_token_id=None, norm_bias=True,
                   mlp_bias=True, attention_bias=True, classifier_bias=True)

# BERT-style encoders (the bert family): embedding models, and cross-encoders with one label
ENCODERS = {
    "bert": (transformers.BertModel, transformers.BertConfig, {}),
    "roberta": (transformers.RobertaModel, transformers.RobertaConfig,
                {**_ROBERTA, "hidden_act": "gelu_new"}),
    "xlm-roberta": (transformers.XLMRobertaModel, transformers.XLMRobertaConfig, _ROBERTA),
    "bert-cls": (transformers.BertForSequenceClassification, transformers.BertConfig,
                 {"num_labels": 1}),
    "bert-cls3": (transformers.BertForSequenceClassification, transformers.BertConfig,
                  {"num_labels": 3, "id2label": {0: "neg", 1: "neutral", 2: "pos"}}),
    "roberta-cls": (transformers.RobertaForSequenceClassification, transformers.RobertaConfig,
                    {**_ROBERTA, "num_labels": 2}),
    # two local layers of a 4-position reach among three, over the 8192 positions of the
    # real models (rotary: the table is not weights); the BERT tokenizer
    "modernbert": (transformers.ModernBertModel, transformers.ModernBertConfig, _MODERNBERT),
    "modernbert-cls": (transformers.ModernBertForSequenceClassification,
                       transformers.ModernBertConfig,
                       {**_MODERNBERT, "num_labels": 2, "classifier_pooling": "mean"}),
    "xlm-roberta-cls": (transformers.XLMRobertaForSequenceClassification,
                        transformers.XLMRobertaConfig, {**_ROBERTA, "num_labels": 1}),
    # DeBERTa-v3's form: relative positions alone, on log buckets (8 here, so the inputs'
    # distances reach the log scale), keys shared with the content's, no token types
    "deberta-v2": (transformers.DebertaV2Model, transformers.DebertaV2Config,
                   {"relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                    "position_biased_input": False, "position_buckets": 8,
                    "max_relative_positions": 128, "norm_rel_ebd": "layer_norm",
                    "share_att_key": True, "type_vocab_size": 0}),
    # DistilBERT: BERT's layers under other names and config keys, no token types; its
    # classifier's head is pre_classifier, ReLU, classifier
    "distilbert": (transformers.DistilBertModel, transformers.DistilBertConfig,
                   {"hidden_dim": 128}),
    "distilbert-cls": (transformers.DistilBertForSequenceClassification,
                       transformers.DistilBertConfig, {"hidden_dim": 128, "num_labels": 3}),
    # NomicBERT and GTE as transformers saves them (the checkpoints' own names:
    # tests/test_bert.py); GTE with biases, one token type and XLM-R's pad id
    "nomic-bert": (transformers.NomicBertModel, transformers.NomicBertConfig, {}),
    "gte": (transformers.GteModel, transformers.GteConfig, {}),
    # DeBERTa-v2's older form: absolute positions and token types too, position keys and
    # queries of their own, a narrower embedding projected up, unbucketed distances
    "deberta-v2-cls": (transformers.DebertaV2ForSequenceClassification,
                       transformers.DebertaV2Config,
                       {"relative_attention": True, "pos_att_type": "c2p|p2c",
                        "position_biased_input": True, "max_relative_positions": 16,
                        "type_vocab_size": 2, "embedding_size": 48, "num_labels": 1,
                        "pooler_hidden_act": "tanh"}),
}
#: architectures of checkpoints saved by their own code (remote code) -> the ENCODERS kind
#: whose transformers model tests/test_bert.py saves in that form, names and config keys
OWN_FORMS = {"NewModel": "gte"}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps KV blocks in a pool; the scheduler hands them out.",
    "Caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e and emoji \U0001f680 are bytes too.",
    "def add(a, b):\n    return a + b\n",
] * 4
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def save_tokenizer(directory: Path) -> None:
    """A byte-level BPE (300 tokens, ids 0-2 special) trained on a few lines, saved the
    way transformers saves tokenizers, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def add_chat_markers(directory: Path) -> None:
    """Qwen's chat markers in the tokenizer saved in ``directory``: ``<|im_start|>`` and
    ``<|im_end|>`` special tokens, ``<think>`` and ``</think>`` added ones (ids 300-303)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's: added, not special
    tokenizer.save_pretrained(directory)


@torch.no_grad()
def randomise_weights(model, std: float) -> None:
    """Norm weights uniform in [0.8, 1.2], every other parameter normal(0, ``std``)."""
    for name, p in model.named_parameters():
        if "norm" in name.lower() or ".ln_" in name:
            p.uniform_(0.8, 1.2)
        else:
            p.normal_(0.0, std)


def build_tiny(kind: str, directory: Path, seed: int = 0, std: float = 0.3, **config):
    """Save a tiny ``kind`` model with weights scaled so logits are O(1–10); return it.

    ``config`` overrides entries of the transformers config (e.g. ``head_dim``).
    """
    torch.manual_seed(seed)
    model_cls, config_cls, extra = {**FAMILIES, **BARE, **CLASSIFIERS}[kind]
    model = model_cls(config_cls(**{**COMMON, **extra, **config})).eval()
    randomise_weights(model, std)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return model


def save_encoder_tokenizer(directory: Path, roberta: bool) -> None:
    """BERT's WordPiece tokenizer ([CLS] a [SEP] b [SEP], the second text of type 1) or
    RoBERTa's byte-level BPE (<s> a </s></s> b </s>), trained on a few lines and saved the
    way transformers saves tokenizers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    if roberta:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
                     pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300,
                                                                  special_tokens=specials))
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                     unk_token="[UNK]", mask_token="[MASK]")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(
        directory)


def build_tiny_encoder(kind: str, directory: Path, seed: int = 0, std: float = 0.3):
    """Save a tiny BERT-style ``kind`` model (`ENCODERS`) with its tokenizer; return it."""
    torch.manual_seed(seed)
    model_cls, config_cls, extra = ENCODERS[kind]
    model = model_cls(config_cls(**{**ENCODER_COMMON, **extra})).eval()
    randomise_weights(model, std)
    model.save_pretrained(directory)
    save_encoder_tokenizer(directory, roberta="roberta" in kind)
    return model
