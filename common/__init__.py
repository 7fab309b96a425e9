"""Shared engine core: config, model, paged KV cache, attention, sampler, scheduler."""
