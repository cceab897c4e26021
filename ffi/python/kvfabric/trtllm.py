"""kvfabric behind TensorRT-LLM's KV cache connector (PyTorch backend, 1.1 and later).

Configure it with::

    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    LLM(model=..., backend="pytorch", cuda_graph_config=None,
        kv_connector_config=KvCacheConnectorConfig(
            connector_module="kvfabric.trtllm",
            connector_scheduler_class="KvfabricScheduler",
            connector_worker_class="KvfabricWorker"))

and the kvfabric config (``name``, ``secret``, and the store's keys, as for vLLM) as JSON in
``$KVFABRIC_CONNECTOR_CONFIG`` (or ``@/path/to/file.json``): TensorRT-LLM's connector config
has no field for it.

The halves share :mod:`kvfabric.connector` with the vLLM connector: the scheduler (rank 0)
asks the worker stores of every rank; each worker owns a store. TensorRT-LLM hands the
worker one pool tensor, ``[num_blocks, num_layers, 2, tokens_per_block * kv_heads *
head_dim]``, where ``pool[block_id]`` is a whole block (every layer, K and V): one piece per
block. The pool lives in GPU memory: where kvfabric has CUDA it is registered as GPU memory
and saves and loads copy straight between it and the store's host tier (D2H and H2D on
kvfabric's stream; a save first synchronises the engine's stream, so the forward pass has
written the blocks). Where registering it fails (a kvfabric without CUDA), blocks go through
a pinned host staging buffer: loads land in it and are copied to the pool on the engine's
stream, saves are copied out of the pool and synchronised on the stream before the store
reads them. Host tensors are registered directly.

A limit of TensorRT-LLM's interface: a worker cannot report that a promised block failed to
load (vLLM's connector reports such blocks and vLLM recomputes them). The window is the
time between the scheduler's lookup and the load in the same step; a block evicted or a peer
lost in it is logged and counted (``load_failed_blocks``, ``KvfabricWorker.load_errors``)
but the engine is not told. Give the host tier room (``host_blocks``) to keep that rare.

What cannot be tested here (no GPU, no TensorRT-LLM): the engine itself, its streams, and the
staging copies on a real device; the tests drive both halves with the engine's call sequence
over numpy buffers (tests/test_trtllm.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from . import KvfError
from .connector import SchedulerLookup, WorkerStore, log

try:  # pragma: no cover - exercised only where TensorRT-LLM is installed
    try:
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore
            KvCacheConnectorScheduler,
            KvCacheConnectorWorker,
        )
    except ImportError:
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore
            KvCacheConnectorScheduler,
            KvCacheConnectorWorker,
        )
    HAVE_TRTLLM = True
except ImportError:  # stand-ins with the same surface
    HAVE_TRTLLM = False

    class KvCacheConnectorScheduler:
        def __init__(self, llm_args):
            self._llm_args = llm_args

    class KvCacheConnectorWorker:
        def __init__(self, llm_args):
            self._llm_args = llm_args
            self._metadata = None

        def bind_connector_meta(self, metadata):
            self._metadata = metadata

        def get_connector_meta(self):
            return self._metadata

        def _clear_connector_meta(self):
            self._metadata = None


def connector_config(env: Optional[dict] = None) -> dict:
    """The kvfabric config from ``$KVFABRIC_CONNECTOR_CONFIG`` (JSON, or ``@file``)."""
    raw = (env or os.environ).get("KVFABRIC_CONNECTOR_CONFIG", "")
    if raw.startswith("@"):
        with open(raw[1:]) as f:
            raw = f.read()
    if not raw.strip():
        raise ValueError("kvfabric: set KVFABRIC_CONNECTOR_CONFIG to the kvfabric config (JSON with name and secret)")
    cfg = json.loads(raw)
    if not isinstance(cfg, dict):
        raise ValueError("kvfabric: KVFABRIC_CONNECTOR_CONFIG must be a JSON object")
    return cfg


def _tokens_per_block(llm_args) -> int:
    kv = getattr(llm_args, "kv_cache_config", None)
    for v in (getattr(kv, "tokens_per_block", None), getattr(llm_args, "tokens_per_block", None)):
        if v:
            return int(v)
    return 32  # TensorRT-LLM's default


def _world(llm_args) -> int:
    tp = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(llm_args, "pipeline_parallel_size", 1) or 1)
    return tp * pp


def _rank() -> int:
    try:
        from tensorrt_llm._utils import mpi_rank  # type: ignore

        return int(mpi_rank())
    except Exception:  # noqa: BLE001 - no TensorRT-LLM or no MPI: one rank
        return 0


@dataclass
class _Req:
    tokens: list[int]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # prompt blocks handed to the workers for saving


class KvfabricScheduler(KvCacheConnectorScheduler):
    """Rank 0's half: lookups, and the loads and saves of each step."""

    def __init__(self, llm_args, config: Optional[dict] = None):
        super().__init__(llm_args)
        cfg = dict(config if config is not None else connector_config())
        self._bs = _tokens_per_block(llm_args)
        self._lookup = SchedulerLookup(cfg, self._bs, world_size=_world(llm_args))
        self._async_save = str(cfg.get("async_save", True)).lower() not in ("0", "false", "no", "off")
        self._loads: dict[int, tuple[int, int]] = {}  # request id -> (first block, blocks)
        self._reqs: dict[int, _Req] = {}

    @property
    def stats(self):
        return self._lookup.stats

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.get_tokens(0))[: int(getattr(request, "prompt_len", 0) or 0) or None]
        matched = self._lookup.matched_tokens(prompt, num_computed_tokens)
        if num_computed_tokens % self._bs:
            matched = 0  # loads start at a block boundary
        if matched > 0:
            self._loads[request.request_id] = (num_computed_tokens // self._bs, matched // self._bs)
        return matched, False

    def update_state_after_alloc(self, request, block_ids: list[int]):
        pass  # the step's scheduler output carries the block ids

    def build_connector_meta(self, scheduler_output) -> dict:
        """``{"load": [(req, tokens, first, block_ids)], "save": [...]}``, picklable."""
        bs = self._bs
        meta = {"load": [], "save": []}
        for r in scheduler_output.new_requests:
            req = self._reqs[r.request_id] = _Req(list(r.new_tokens), len(r.new_tokens), list(r.new_block_ids))
            load = self._loads.pop(r.request_id, None)
            done = r.computed_position + r.num_scheduled_tokens
            if load is not None:
                first, n = load
                meta["load"].append((r.request_id, req.tokens[: (first + n) * bs], first, req.block_ids[first:first + n]))
                done += n * bs  # computed_position leaves out the tokens the connector provides
            self._plan_save(meta, r.request_id, req, done)
        for r in scheduler_output.cached_requests:
            req = self._reqs.get(r.request_id)
            if req is None:
                continue
            req.tokens.extend(r.new_tokens)
            req.block_ids.extend(r.new_block_ids)
            self._plan_save(meta, r.request_id, req, r.computed_position + r.num_scheduled_tokens)
        return meta

    def _plan_save(self, meta, rid, req: _Req, done: int):
        full = min(done, req.prompt_len) // self._bs
        if full > req.saved and len(req.block_ids) >= full:
            first = req.saved
            meta["save"].append((rid, req.tokens[: full * self._bs], first, req.block_ids[first:full]))
            req.saved = full

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        req = self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return bool(self._async_save and req is not None and req.saved > 0)

    def shutdown(self):
        self._lookup.close()


class KvfabricWorker(KvCacheConnectorWorker):
    """One rank's half: its store, the engine's pool, loads and saves."""

    def __init__(self, llm_args, config: Optional[dict] = None, rank: Optional[int] = None):
        super().__init__(llm_args)
        self._cfg = dict(config if config is not None else connector_config())
        self._cfg["block_tokens"] = _tokens_per_block(llm_args)
        self._rank = _rank() if rank is None else rank
        self._store: Optional[WorkerStore] = None
        self._pool = None
        self._staging = None  # (host buffer, its blocks) when the pool is in device memory
        self._direct_gpu = False  # the GPU pool is registered with kvfabric itself
        # Whether the scheduler keeps a finished request's blocks until get_finished reports
        # it (the same config key on both halves).
        self._delay = str(self._cfg.get("async_save", True)).lower() not in ("0", "false", "no", "off")
        self._saving: set[int] = set()
        self._finishing: set[int] = set()
        self.load_errors: dict[int, int] = {}  # request id -> blocks that did not arrive

    @property
    def store(self) -> WorkerStore:
        if self._store is None:
            raise RuntimeError("kvfabric: register_kv_caches has not run")
        return self._store

    def register_kv_caches(self, kv_cache_tensor):
        """The pool ``[num_blocks, layers, 2, tokens * heads * head_dim]``: one piece per
        block. Device pools get a pinned host staging buffer of ``staging_blocks``."""
        shape = tuple(kv_cache_tensor.shape)
        n = shape[0]
        nbytes = int(kv_cache_tensor.nbytes) if hasattr(kv_cache_tensor, "nbytes") else (
            int(kv_cache_tensor.numel()) * int(kv_cache_tensor.element_size()))
        block = nbytes // n
        self._cfg["block_bytes"] = block
        self._store = WorkerStore(self._cfg, rank=self._rank)
        device = getattr(getattr(kv_cache_tensor, "device", None), "type", "cpu")
        self._pool = kv_cache_tensor
        if device == "cpu":
            self._store.register([(kv_cache_tensor, 0, block, block)])
        else:  # pragma: no cover - needs a GPU
            import torch

            try:
                self._store.register([(kv_cache_tensor, 0, block, block)])
                self._direct_gpu = True
                return
            except KvfError as e:  # no CUDA in this kvfabric: stage through host memory
                log.warning("kvfabric: the GPU pool is staged through host memory (%s)", e)
            k = int(self._cfg.get("staging_blocks", 256))
            host = torch.empty((k,) + shape[1:], dtype=kv_cache_tensor.dtype, pin_memory=True)
            self._staging = (host, k)
            self._store.register([(host, 0, block, block)])
            # The staging rows are reused chunk after chunk: each save ends before the next.
            self._store.async_save = False

    # The engine's per-step calls.

    def start_load_kv(self, stream=None):
        meta = self.get_connector_meta() or {"load": [], "save": []}
        for rid, tokens, first, ids in meta["load"]:
            loaded = self._move(tokens, first, ids, stream, load=True)
            if loaded < len(ids):
                # TensorRT-LLM's interface has no way to report a failed load (vLLM's has
                # get_block_ids_with_load_errors): a short load is logged and counted here,
                # and the engine uses the blocks as they are. See the module's note.
                self.load_errors[rid] = len(ids) - loaded

    def wait_for_layer_load(self, layer_idx: int, stream=None):
        pass  # start_load_kv completed every layer (a kvfabric block carries them all)

    def save_kv_layer(self, layer_idx: int, stream=None):
        pass  # blocks are saved whole in wait_for_save, after the forward pass

    def wait_for_save(self, stream=None):
        meta = self.get_connector_meta() or {"load": [], "save": []}
        for rid, tokens, first, ids in meta["save"]:
            self._move(tokens, first, ids, stream, load=False, req_id=rid)
            if self._delay:
                self._saving.add(rid)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self._finishing |= set(finished_gen_req_ids) & self._saving
        done = self.store.saves_done([str(r) for r in self._finishing])
        finished = [r for r in self._finishing if str(r) in done]
        self._finishing -= set(finished)
        self._saving -= set(finished)
        return finished, []

    def _move(self, tokens, first, ids, stream, load: bool, req_id=None) -> int:
        st = self.store
        if self._direct_gpu and not load and stream is not None:  # pragma: no cover - GPU
            stream.synchronize()  # the forward pass has written the blocks before they are read
        if self._staging is None:
            if load:
                return st.finish_load(st.start_load(tokens, first, ids), len(ids))
            st.save(str(req_id), tokens, first, ids)
            return len(ids)
        # Device pool: through the staging buffer, a chunk at a time (pragma: needs a GPU).
        host, k = self._staging  # pragma: no cover
        done = 0  # pragma: no cover
        for at in range(0, len(ids), k):  # pragma: no cover
            chunk = ids[at:at + k]
            slots = list(range(len(chunk)))
            if load:
                got = st.finish_load(st.start_load(tokens, first + at, slots), len(chunk))
                if got:
                    self._pool[chunk[:got]] = host[:got].to(self._pool.device, non_blocking=True)
                    if stream is not None:
                        stream.synchronize()  # the staging rows are reused next chunk
                done += got
                if got < len(chunk):
                    break
            else:
                host[: len(chunk)].copy_(self._pool[chunk], non_blocking=True)
                if stream is not None:
                    stream.synchronize()
                st.save(str(req_id), tokens, first + at, slots)
                done += len(chunk)
        return done

    def shutdown(self):
        if self._store is not None:
            self._store.close()
            self._store = None
