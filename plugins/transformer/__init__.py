"""Decoder-only transformer family."""
