"""The TensorRT-LLM connector halves, driven with TensorRT-LLM's call sequence (scheduler on
rank 0: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
request_finished; worker: register_kv_caches, bind_connector_meta, start_load_kv, the layer
hooks, wait_for_save, get_finished) over a numpy pool in its layout
``[num_blocks, num_layers, 2, tokens_per_block * kv_heads * head_dim]``.

What this cannot prove: anything about TensorRT-LLM's own objects beyond the attributes used
here (their names follow its kv_cache_connector module), GPU pools and the staging copies on
CUDA streams.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from kvfabric.trtllm import KvfabricScheduler, KvfabricWorker, connector_config

SECRET = "trtllm-test-secret"
BS, LAYERS, HEADS, DIM, BLOCKS = 16, 3, 2, 8, 48


def fill(tokens, positions, layer, plane):
    t = np.asarray(tokens, dtype=np.float64)[:, None]
    p = np.asarray(positions, dtype=np.float64)[:, None]
    d = np.arange(HEADS * DIM, dtype=np.float64)[None, :]
    return np.cos(t * 0.011 + p * 0.3 + layer * 0.9 + plane * 1.7 + d * 0.05).astype(np.float16)


class Engine:
    """A fake TensorRT-LLM executor: one rank, its pool, and the connector's halves."""

    def __init__(self, name, cfg):
        cfg = dict(cfg, name=name)
        args = SimpleNamespace(kv_cache_config=SimpleNamespace(tokens_per_block=BS), tensor_parallel_size=1)
        self.worker = KvfabricWorker(args, config=cfg, rank=0)
        self.pool = np.zeros((BLOCKS, LAYERS, 2, BS * HEADS * DIM), dtype=np.float16)
        self.worker.register_kv_caches(self.pool)
        self.scheduler = KvfabricScheduler(args, config=cfg)
        self.free = list(range(BLOCKS))
        self.next_id = 1

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()

    def write(self, ids, tokens, start, end):
        for pos in range(start, end):
            b, off = ids[pos // BS], pos % BS
            for layer in range(LAYERS):
                for plane in (0, 1):
                    row = fill([tokens[pos]], [pos], layer, plane)[0]
                    self.pool[b, layer, plane].reshape(BS, HEADS * DIM)[off] = row

    def kv(self, ids, tokens, n):
        out = []
        for pos in range(n):
            b, off = ids[pos // BS], pos % BS
            out.append([[self.pool[b, l, p].reshape(BS, HEADS * DIM)[off] for p in (0, 1)] for l in range(LAYERS)])
        return np.asarray(out)

    def expected(self, tokens, n):
        return np.asarray([[[fill([tokens[pos]], [pos], l, p)[0] for p in (0, 1)] for l in range(LAYERS)]
                           for pos in range(n)])

    def serve(self, prompt, chunk=None):
        """Runs a request's context phase (in chunks) and one generation step; returns
        (tokens the connector provided, block ids, request id)."""
        rid = self.next_id
        self.next_id += 1
        req = SimpleNamespace(request_id=rid, prompt_len=len(prompt), get_tokens=lambda beam: list(prompt))
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert not is_async
        ids = [self.free.pop(0) for _ in range(-(-(len(prompt) + 1) // BS))]
        self.scheduler.update_state_after_alloc(req, ids)
        pos, first = matched, True
        chunk = chunk or len(prompt)
        while pos < len(prompt):
            n = min(chunk, len(prompt) - pos)
            data = SimpleNamespace(request_id=rid, new_tokens=list(prompt) if first else [],
                                   new_block_ids=ids if first else [],
                                   computed_position=0 if first else pos, num_scheduled_tokens=n)
            out = SimpleNamespace(new_requests=[data] if first else [], cached_requests=[] if first else [data])
            self.step(out, lambda: self.write(ids, prompt, pos, pos + n))
            pos += n
            first = False
        # One generation step (nothing to save: the prompt's blocks are done).
        data = SimpleNamespace(request_id=rid, new_tokens=[7], new_block_ids=[], computed_position=len(prompt),
                               num_scheduled_tokens=1)
        self.step(SimpleNamespace(new_requests=[], cached_requests=[data]), lambda: None)
        return matched, ids, rid

    def step(self, out, forward):
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        for layer in range(LAYERS):
            self.worker.wait_for_layer_load(layer, None)
            self.worker.save_kv_layer(layer, None)
        forward()
        self.worker.wait_for_save(None)
        self.worker._clear_connector_meta()
        self.worker.get_finished([], [])

    def finish(self, rid, ids):
        import time

        delay = self.scheduler.request_finished(SimpleNamespace(request_id=rid), ids)
        new = [rid]
        deadline = time.monotonic() + 30
        while delay:
            saved, loaded = self.worker.get_finished(new, [])
            new = []
            assert loaded == []
            if saved:
                assert saved == [rid]
                break
            assert time.monotonic() < deadline
            time.sleep(0.001)
        self.free.extend(ids)


def prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 30_000, size=n)]



def follows(b, a):
    """Waits until B's worker store uses A's as a fabric node (found in discovery)."""
    deadline = time.monotonic() + 10
    while f"{a.worker.store.instance}-rank0" not in b.worker.store.metrics()["fabric_nodes"]:
        assert time.monotonic() < deadline, b.worker.store.metrics()
        time.sleep(0.01)

def test_config_comes_from_the_environment(tmp_path):
    assert connector_config({"KVFABRIC_CONNECTOR_CONFIG": '{"name": "x", "secret": "s"}'}) == {"name": "x", "secret": "s"}
    f = tmp_path / "c.json"
    f.write_text('{"name": "y"}')
    assert connector_config({"KVFABRIC_CONNECTOR_CONFIG": f"@{f}"}) == {"name": "y"}
    for bad in ("", "[1]"):
        try:
            connector_config({"KVFABRIC_CONNECTOR_CONFIG": bad})
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_chunked_prefill_saves_and_another_engine_loads(tmp_path):
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = Engine("trt-a", cfg)
    b = Engine("trt-b", cfg)
    try:
        p = prompt(100, seed=1)  # 6 full blocks and 4 tokens
        matched, ids, rid = a.serve(p, chunk=40)  # three context chunks
        assert matched == 0
        assert np.array_equal(a.kv(ids, p, 100), a.expected(p, 100))
        a.finish(rid, ids)
        assert a.worker.store.stats.total["saved_blocks"] == 6
        # B: the scheduler sees A's blocks through B's worker store; the worker loads them.
        follows(b, a)
        matched, ids_b, rid_b = b.serve(p)
        assert matched == 96
        assert np.array_equal(b.kv(ids_b, p, 100), b.expected(p, 100))
        assert b.worker.store.stats.total["loaded_blocks"] == 6 and not b.worker.load_errors
        b.finish(rid_b, ids_b)
        # A prompt that shares two blocks with it.
        q = p[:32] + prompt(30, seed=2)
        matched, ids_q, rid_q = b.serve(q)
        assert matched == 32
        assert np.array_equal(b.kv(ids_q, q, 62), b.expected(q, 62))
        b.finish(rid_q, ids_q)
    finally:
        b.close()
        a.close()


def test_a_lost_peer_is_a_counted_short_load(tmp_path):
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = Engine("trt-lost-a", cfg)
    b = Engine("trt-lost-b", cfg)
    try:
        p = prompt(64, seed=3)
        _, ids, rid = a.serve(p)
        a.finish(rid, ids)
        follows(b, a)
        req = SimpleNamespace(request_id=99, prompt_len=len(p), get_tokens=lambda beam: list(p))
        assert b.scheduler.get_num_new_matched_tokens(req, 0) == (48, False)
        a.close()
        a = None
        ids_b = [b.free.pop(0) for _ in range(4)]
        data = SimpleNamespace(request_id=99, new_tokens=p, new_block_ids=ids_b, computed_position=0,
                               num_scheduled_tokens=16)
        b.worker.bind_connector_meta(b.scheduler.build_connector_meta(
            SimpleNamespace(new_requests=[data], cached_requests=[])))
        b.worker.start_load_kv(None)
        assert b.worker.load_errors == {99: 3}
        assert b.worker.store.stats.total["load_failed_blocks"] == 3
    finally:
        b.close()
        if a is not None:
            a.close()
