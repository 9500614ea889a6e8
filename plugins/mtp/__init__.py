"""Speculative-decoding proposers: prompt lookup (n-gram) and MTP heads."""
