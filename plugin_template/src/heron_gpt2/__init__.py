"""GPT-2 (``GPT2LMHeadModel``) served by heron: a model-family plugin."""

__version__ = "0.1.0"
