"""Quotas: in-process token buckets, the shared Redis backend and its scripts."""
