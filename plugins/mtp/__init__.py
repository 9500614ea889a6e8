"""Speculative-decoding proposers: prompt lookup (n-gram)."""
