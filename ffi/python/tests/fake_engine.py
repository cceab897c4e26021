"""A small fake engine that drives the connector the way vLLM's scheduler and model runner
do, over paged KV buffers it owns as numpy arrays (vLLM's layout per layer:
[2, num_blocks, block_size, num_kv_heads, head_size]). Its "model" writes a deterministic
function of (token, position, layer, plane) into the KV of each computed token, so any KV
can be checked against a recomputation.

What this fake cannot prove: anything about vLLM's own objects beyond the attributes used
here, GPU memory, or layer-by-layer pipelining; its asynchronous loads follow vLLM 0.32's
scheduler (a request waits with its blocks allocated until the workers report its load),
not other versions'.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvfabric.vllm import KVConnectorRole, KvfabricConnector


def kv_value(tokens, positions, layer, plane, heads, head_dim):
    """The fake model's K (plane 0) or V (plane 1) rows for some tokens."""
    t = np.asarray(tokens, dtype=np.float64)[:, None, None]
    p = np.asarray(positions, dtype=np.float64)[:, None, None]
    h = np.arange(heads, dtype=np.float64)[None, :, None]
    d = np.arange(head_dim, dtype=np.float64)[None, None, :]
    x = np.sin(t * 0.013 + p * 0.7 + layer * 1.3 + plane * 2.1 + h * 0.37 + d * 0.11)
    return x.astype(np.float16)


class KVCacheBlocks:
    def __init__(self, ids):
        self._ids = list(ids)

    def get_block_ids(self):
        return (list(self._ids),)


class FakeEngine:
    def __init__(self, name, kvf_config, num_layers=3, num_blocks=32, block_size=16, heads=2, head_dim=8,
                 connector_output=True):
        # connector_output=False: a vLLM whose scheduler never calls update_connector_output.
        self.connector_output = connector_output
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.heads, self.head_dim = heads, head_dim
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        page = 2 * block_size * heads * head_dim * np.dtype(np.float16).itemsize
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=block_size),
            kv_transfer_config=SimpleNamespace(
                kv_connector="KvfabricConnector",
                kv_connector_extra_config={"kvfabric": dict(kvf_config, name=name)},
            ),
        )
        self.kv_cache_config = SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_groups=[
                SimpleNamespace(layer_names=self.layer_names, kv_cache_spec=SimpleNamespace(page_size_bytes=page))
            ],
        )
        self.scheduler = KvfabricConnector(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.worker = KvfabricConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = {
            n: np.zeros((2, num_blocks, block_size, heads, head_dim), dtype=np.float16) for n in self.layer_names
        }
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(num_blocks))
        self.computed_tokens = 0  # tokens the fake model computed in the last prefill

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()

    def prefill(self, req_id, prompt, timeout=30.0, cache_salt=None):
        """Schedules and runs one prefill; returns (tokens loaded externally, block ids, block
        ids whose load failed). A hit the connector loads asynchronously first waits, as in
        vLLM's WAITING_FOR_REMOTE_KVS, over steps that run nothing but the connector's
        transfers, until the worker reports the load finished. ``cache_salt`` is vLLM's
        per-request salt (the Request attribute)."""
        import time

        bs = self.block_size
        request = SimpleNamespace(request_id=req_id, prompt_token_ids=list(prompt), num_tokens=len(prompt),
                                  cache_salt=cache_salt)
        matched, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        n_blocks = -(-len(prompt) // bs)
        ids = [self.free.pop(0) for _ in range(n_blocks)]
        self.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), matched)
        errors = set()
        self.load_steps = 0
        if is_async:
            deadline = time.monotonic() + timeout
            while True:
                # A step with nothing scheduled: vLLM's kv_connector_no_forward.
                meta = self.scheduler.build_connector_meta(self._empty_step())
                self.worker.bind_connector_metadata(meta)
                self.worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
                self.worker.wait_for_save()
                sending, recving = self.worker.get_finished(set())
                errors |= self.worker.get_block_ids_with_load_errors()
                self.worker.clear_connector_metadata()
                if self.connector_output:
                    self.scheduler.update_connector_output(SimpleNamespace(finished_recving=recving))
                self.load_steps += 1
                if recving and req_id in recving:
                    break
                assert time.monotonic() < deadline, f"the load of {req_id} never finished"
                time.sleep(0.001)
        new = SimpleNamespace(req_id=req_id, prompt_token_ids=list(prompt), block_ids=(ids,), num_computed_tokens=matched)
        out = SimpleNamespace(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req_id: len(prompt) - matched},
            finished_req_ids=set(),
        )
        meta = self.scheduler.build_connector_meta(out)
        # The model runner's side.
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
        positions = np.arange(matched, len(prompt))
        for li, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            for plane in (0, 1):
                rows = kv_value(np.asarray(prompt)[positions], positions, li, plane, self.heads, self.head_dim)
                for row, pos in zip(rows, positions):
                    self.kv[name][plane, ids[pos // bs], pos % bs] = row
            self.worker.save_kv_layer(name, self.kv[name], None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.computed_tokens = len(positions)
        errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.get_finished(set())
        return matched, ids, errors

    @staticmethod
    def _empty_step():
        return SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
            finished_req_ids=set(),
        )

    def finish(self, req_id, ids, timeout=30.0):
        """Finishes a request as vLLM does: blocks whose saves may still run are freed once
        the worker reports the request in get_finished."""
        import time

        delay, params = self.scheduler.request_finished(SimpleNamespace(request_id=req_id), ids)
        assert params is None
        finished = {req_id}
        deadline = time.monotonic() + timeout
        while delay:
            sending, recving = self.worker.get_finished(finished)
            finished = set()
            assert recving is None
            if sending:
                assert sending == {req_id}
                break
            assert time.monotonic() < deadline, f"the saves of {req_id} never finished"
            time.sleep(0.001)
        self.free.extend(ids)

    def token_kv(self, ids, n_tokens):
        """The KV held for the first n_tokens of a request with these blocks, per layer."""
        bs = self.block_size
        out = []
        for name in self.layer_names:
            rows = [self.kv[name][:, ids[p // bs], p % bs] for p in range(n_tokens)]
            out.append(np.stack(rows))
        return np.stack(out)

    def reference_kv(self, prompt, n_tokens):
        positions = np.arange(n_tokens)
        out = []
        for li in range(self.num_layers):
            planes = [kv_value(np.asarray(prompt)[:n_tokens], positions, li, p, self.heads, self.head_dim) for p in (0, 1)]
            out.append(np.stack(planes, axis=1))
        return np.stack(out)
