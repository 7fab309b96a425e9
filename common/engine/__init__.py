"""The engine: sequences, block pool and manager, scheduler, step loop, sampler, speculation.

Shared by the prefill and decode workers and by `pdserve run-batch`; the model is `common.model`.
"""
