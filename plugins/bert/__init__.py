"""The BERT encoder family: BERT, RoBERTa and XLM-RoBERTa embedding models and cross-encoders."""
