"""Time to load a prompt's KV through the connector's worker store, per tier, against a plain
memcpy of the same bytes measured in the same run.

A prompt of --tokens tokens (default 2000) with SmolLM2-135M's KV (30 layers, 3 KV heads of
64, bf16: 23,040 bytes per token) in blocks of --block tokens (default 32, vLLM's CPU block),
laid out as vLLM's CPU backend lays it out (one buffer per layer, blocks first). Tiers:

- host: the store's own host tier;
- disk: the store's disk tier (O_DIRECT), the host tier too small to hold the prompt;
- remote: another worker store (another process) over the transfer engine.

    KVFABRIC_LIB=target/release/libkvfabric_ffi.so python scripts/bench/connector-tiers.py
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "ffi", "python"))

from kvfabric.connector import WorkerStore  # noqa: E402

LAYERS, KV_HEADS, HEAD = 30, 3, 64


def buffers(num_blocks, block):
    # The CPU backend's per-layer [num_blocks, kv_heads, block, 2 * head] in bf16 (2 bytes).
    return [np.zeros((num_blocks, KV_HEADS, block, 2 * HEAD), dtype=np.uint16) for _ in range(LAYERS)]


def register(store, bufs):
    stride = bufs[0][0].nbytes
    store.register([(b, 0, stride, stride) for b in bufs])


def timed_load(store, tokens, n_blocks, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loaded = store.finish_load(store.start_load(tokens, 0, list(range(n_blocks))), n_blocks)
        out.append(time.perf_counter() - t0)
        assert loaded == n_blocks, f"loaded {loaded} of {n_blocks}"
    return out


def child(args):
    """The remote peer: saves the prompt and serves until stdin closes."""
    cfg = {"name": "bench-peer", "secret": "bench", "node_dir": args.node_dir, "block_tokens": args.block,
           "block_bytes": LAYERS * KV_HEADS * args.block * 2 * HEAD * 2, "host_blocks": 256, "async_save": False}
    st = WorkerStore(cfg)
    n = args.tokens // args.block
    bufs = buffers(n, args.block)
    for b in bufs:
        b[...] = np.random.default_rng(1).integers(0, 65535, size=b.shape, dtype=np.uint16)
    register(st, bufs)
    st.save("p", prompt(args.tokens), 0, list(range(n)))
    print("ready", flush=True)
    sys.stdin.read()
    st.close()


def prompt(n):
    return [int(t) for t in np.random.default_rng(7).integers(1, 40000, size=n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--node-dir")
    args = ap.parse_args()
    if args.child:
        return child(args)
    tmp = tempfile.mkdtemp(prefix="kvf-conn-bench-")
    n = args.tokens // args.block
    block_bytes = LAYERS * KV_HEADS * args.block * 2 * HEAD * 2
    toks = prompt(args.tokens)
    peer = subprocess.Popen([sys.executable, __file__, "--child", "--node-dir", tmp, "--tokens", str(args.tokens),
                             "--block", str(args.block)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline().strip() == "ready"
    rows = {}
    try:
        base = {"secret": "bench", "node_dir": tmp, "block_tokens": args.block, "block_bytes": block_bytes,
                "async_save": False}
        # host and remote: a store with room for the prompt, the peer as its fabric.
        st = WorkerStore(dict(base, name="bench-host", host_blocks=4 * n, serve=False))
        bufs = buffers(n, args.block)
        register(st, bufs)
        rows["remote"] = timed_load(st, toks, n, 1)  # the first load fetches from the peer
        rows["host"] = timed_load(st, toks, n, args.reps)
        st.close()
        # disk: the prompt written through to the disk file; each timed load opens the store
        # again on that file (the index is rebuilt from disk, the host tier is empty).
        dcfg = dict(base, host_blocks=n + 2, disk_path=os.path.join(tmp, "d.disk"), disk_blocks=4 * n,
                    write_through=True, remote=False, serve=False)
        st = WorkerStore(dict(dcfg, name="bench-disk"))
        register(st, buffers(n, args.block))
        st.save("p", toks, 0, list(range(n)))
        deadline = time.monotonic() + 30
        while st.metrics()["disk_used_blocks"] < n:  # written through
            assert time.monotonic() < deadline, st.metrics()
            time.sleep(0.01)
        st.close()
        rows["disk"] = []
        for i in range(args.reps):
            st = WorkerStore(dict(dcfg, name=f"bench-disk-{i}"))
            register(st, buffers(n, args.block))
            rows["disk"] += timed_load(st, toks, n, 1)
            m = st.metrics()
            assert m["onboard_blocks"] >= n, m  # every block came up from disk
            st.close()
        # remote again, several times: fresh stores, each fetching from the peer.
        for i in range(args.reps - 1):
            st = WorkerStore(dict(base, name=f"bench-remote-{i}", host_blocks=4 * n, serve=False))
            register(st, buffers(n, args.block))
            rows["remote"] += timed_load(st, toks, n, 1)
            st.close()
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)
    src = np.ones(n * block_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    mem = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mem.append(time.perf_counter() - t0)
    mem_p50 = statistics.median(mem)
    mb = n * block_bytes / 1e6
    print(f"{args.tokens} tokens = {n} blocks of {block_bytes} bytes = {mb:.1f} MB; memcpy of the same bytes "
          f"p50 {mem_p50 * 1e3:.2f} ms ({mb / 1e3 / mem_p50:.2f} GB/s)")
    print(f"{'tier':<8} {'n':>3} {'p50 ms':>8} {'p99 ms':>8} {'GB/s':>6} {'memcpy/tier':>12}")
    for name in ("host", "disk", "remote"):
        v = sorted(rows[name])
        p50, p99 = statistics.median(v), v[min(len(v) - 1, int(0.99 * len(v)))]
        print(f"{name:<8} {len(v):>3} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f} {mb / 1e3 / p50:>6.2f} {mem_p50 / p50:>12.2f}")


if __name__ == "__main__":
    main()
