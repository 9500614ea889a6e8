"""The bert family: BERT, RoBERTa, XLM-RoBERTa and ModernBERT encoders (embedding models and
cross-encoders)."""
