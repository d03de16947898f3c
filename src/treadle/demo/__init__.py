"""Demonstration workloads that run real recorded agent work through treadle."""
