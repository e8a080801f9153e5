"""Benchmarks: each prints a table, writes a plot, and compares ratios measured in one run."""
