"""The C ABI and the Python binding with an engine's KV buffers in GPU memory: CUDA torch
tensors registered as device regions, blocks saved from and loaded into them through the
store (D2H and H2D on the cuda transport), byte for byte.

Skipped, with the reason, where torch or a CUDA device is missing (this machine and CI);
`scripts/gpu-check.sh run` runs it on a GPU machine with KVFABRIC_EXPECT_CUDA=1, where a
missing GPU fails instead."""

import os

import pytest

import kvfabric
from kvfabric import Agent, KvfError, Store, segments

SECRET = "py-gpu-secret"


def cuda_torch():
    expect = os.environ.get("KVFABRIC_EXPECT_CUDA") == "1"
    try:
        import torch
    except ImportError:
        if expect:
            raise
        pytest.skip("no torch here: the CUDA tensor tests need it")
    if not torch.cuda.is_available():
        if expect:
            pytest.fail("KVFABRIC_EXPECT_CUDA=1 but torch sees no CUDA device")
        pytest.skip("torch sees no CUDA device")
    return torch


def test_blocks_saved_from_and_loaded_into_cuda_tensors():
    torch = cuda_torch()
    block_bytes, n = 64 * 1024, 16
    cfg = {"secret": SECRET, "name": "py-gpu", "block_tokens": 4, "block_bytes": block_bytes,
           "host_blocks": 32}
    with Agent(cfg) as agent, Store(agent, cfg) as store:
        # An engine's KV cache: n blocks of block_bytes on the GPU, as a uint8 tensor.
        src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        torch.cuda.synchronize()
        rs, rd = agent.register(src), agent.register(dst)
        toks = list(range(1000, 1000 + 4 * 6))  # 6 blocks
        with store.save(toks, [3, 1, 4, 15, 9, 2], segments([(rs, 0, block_bytes, block_bytes)])) as op:
            assert op.wait() == 6
        assert store.lookup(toks) == [kvfabric.KVF_TIER_HOST] * 6
        with store.load(toks, [0, 5, 6, 7, 8, 10], segments([(rd, 0, block_bytes, block_bytes)])) as op:
            assert op.wait() == 6
        torch.cuda.synchronize()
        for got, want in zip([0, 5, 6, 7, 8, 10], [3, 1, 4, 15, 9, 2]):
            assert torch.equal(dst[got], src[want]), f"block {want} -> {got}"
        # Untouched blocks stay zero.
        assert int(dst[1].sum()) == 0
        # A GPU region out of bounds is refused, typed, like a host one.
        with pytest.raises(KvfError) as e:
            store.load(toks, [n], segments([(rd, 0, block_bytes, block_bytes)]))
        assert e.value.name == "KVF_OUT_OF_BOUNDS"
