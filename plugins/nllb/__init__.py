"""NLLB-200 / M2M100 encoder-decoder translation family."""
