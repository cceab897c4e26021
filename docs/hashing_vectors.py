#!/usr/bin/env python3
"""Recomputes the test vectors of docs/hashing.md with the `xxhash` package (pip install xxhash).

Independent of kvfabric's Rust code: if this script and `kvfabric hash` disagree, one is wrong.
"""
import struct
import xxhash

SEED = 1337


def block_hash(tokens, seed=SEED):
    return xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(tokens), *tokens), seed=seed)


def seq_hashes(tokens, block_tokens, seed=SEED):
    out, parent = [], None
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        b = block_hash(tokens[i : i + block_tokens], seed)
        s = b if parent is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, b), seed=SEED)
        out.append((b, s))
        parent = s
    return out


def hash_seed(lora=None, salt=None):
    seed = SEED
    if lora:
        seed = (seed + xxhash.xxh3_64_intdigest(lora.encode(), seed=0)) % 2**64
    if salt:
        seed = (seed + xxhash.xxh3_64_intdigest(salt.encode(), seed=1)) % 2**64
    return seed


if __name__ == "__main__":
    toks = list(range(16))
    pairs = seq_hashes(toks, 4)
    print("tokens 0..15, block_tokens 4")
    print("  block_hashes   ", [b for b, _ in pairs])
    print("  sequence_hashes", [s for _, s in pairs])
    print("block_hash([1,2,3,4])", block_hash([1, 2, 3, 4]))
    print("seed lora=my-lora          ", hash_seed("my-lora"))
    print("seed salt=tenant-a         ", hash_seed(None, "tenant-a"))
    print("seed lora=my-lora,salt=tenant-a", hash_seed("my-lora", "tenant-a"))
    salted = seq_hashes(toks[:8], 4, hash_seed(None, "tenant-a"))
    print("salt=tenant-a tokens 0..7 sequence_hashes", [s for _, s in salted])
