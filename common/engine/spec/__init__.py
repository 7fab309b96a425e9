"""Speculative decoding: draft proposers (n-gram, draft model), verification of drafts, the
governor."""
