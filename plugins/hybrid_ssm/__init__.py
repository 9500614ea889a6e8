"""Mamba2 and Mamba2/attention hybrid family."""
