"""Parallel strategies; each module is one strategy."""
