"""Block keys for prefix caching, shared by the workers' caches and the router's index.

A full block's key is a 128-bit BLAKE2b digest of (parent key, salt, the block's token ids), so two
equal keys mean two equal prefixes up to and including that block (a collision is as unlikely as a
random 128-bit match; the block pool still compares tokens before reusing a block). Only full blocks
have keys: a partly filled block is never shared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16


def model_salt(model_id: str, dtype: str = "", block_size: int = 0, kv_dtype: str = "") -> bytes:
    """Salt that keeps keys of different models, dtypes, block sizes or KV cache dtypes apart
    (`kv_dtype` '' for a cache in the model's dtype: the keys of before it existed)."""
    text = f"{model_id}|{dtype}|{block_size}" + (f"|kv={kv_dtype}" if kv_dtype else "")
    text = text.encode()
    return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()


def block_key(parent: bytes | None, tokens: Sequence[int], salt: bytes) -> bytes:
    """Key of one full block, chained to its parent block's key (None for the first block)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent if parent is not None else b"\x00" * KEY_BYTES)
    h.update(salt)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    salt: bytes,
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Keys of the full blocks of `tokens` from block `start_block` on, chained from `parent`.

    `parent` must be the key of block `start_block - 1` (None when starting at block 0).
    """
    num_blocks = len(tokens) // block_size
    if num_blocks <= start_block:
        return []
    # The blocks' token bytes in one conversion (as `block_key` hashes them), then sliced: a
    # conversion per block cost three quarters of the time (a 4,096-token prompt: 0.9 ms).
    data = np.asarray(tokens[start_block * block_size : num_blocks * block_size], dtype=np.int64)
    raw, step = data.tobytes(), 8 * block_size
    zero = b"\x00" * KEY_BYTES
    keys: list[bytes] = []
    for offset in range(0, len(raw), step):
        h = hashlib.blake2b(parent if parent is not None else zero, digest_size=KEY_BYTES)
        h.update(salt)
        h.update(raw[offset : offset + step])
        parent = h.digest()
        keys.append(parent)
    return keys
