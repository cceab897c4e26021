"""A KV connector for vLLM's V1 interface (``KVConnectorBase_V1``), backed by kvfabric.

It follows vLLM's method names and argument shapes; with vLLM installed it subclasses
vLLM's base class, without it a small stand-in with the same surface, so that engines (and
tests) that own plain numpy buffers can drive it.

How it maps onto kvfabric:

- Both roles of one engine process share one kvfabric agent and store (named by the
  ``name`` key of the kvfabric config): the scheduler side looks prefixes up in it, the
  worker side loads and saves the engine's paged buffers through it. NOTE: a real vLLM V1
  runs the scheduler (engine core) and the worker in different processes, so there each
  role has its own store and the scheduler's lookups never see the worker's saves; the
  scheduler side must reach the worker's store as a fabric node (issue "engine
  connectors"). Observed in vLLM 0.32 on CPU: the worker side registers the CPU backend's
  caches and the engine serves; nothing is ever loaded.
- Scheduler side: ``get_num_new_matched_tokens`` hashes the prompt (kvfabric's hashing,
  the same as the router's) and looks it up in every tier, local and remote, in whole
  blocks, leaving at least one prompt token to compute. ``update_state_after_alloc``
  records which of the request's blocks receive the external tokens.
  ``build_connector_meta`` emits, per request, the blocks to load and the full prompt
  blocks computed by the end of the step to save.
- Worker side: ``register_kv_caches`` registers each layer's buffer (vLLM's layout,
  ``[2, num_blocks, block_size, num_kv_heads, head_size]``) and describes a kvfabric block
  as two segments per layer (K and V). ``start_load_kv`` starts the loads,
  ``wait_for_layer_load`` waits for them (a kvfabric block holds every layer, so the first
  layer's wait covers all), ``save_kv_layer`` records the layer, and ``wait_for_save`` stores
  the step's new blocks once every layer has been written. Loads and saves complete within
  the step, so ``get_finished`` reports nothing asynchronous; blocks that could not be loaded
  are reported by ``get_block_ids_with_load_errors``.
- Sharing between engines: the store serves its blocks to peers (``serve``) and uses other
  engines' stores as its remote tier (``remote``), found in discovery (etcd) or added with
  :meth:`KvfabricConnector.add_node`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from . import Agent, Store, segments

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError:  # the stand-ins: same names and surface as vLLM's

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # noqa: B903
        """Scheduler -> worker metadata of one step."""

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None


@dataclass
class ReqMeta:
    """What the worker does for one request in one step."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    # (first logical block, number of blocks) to load / to save, or None.
    load: Optional[tuple[int, int]] = None
    save: Optional[tuple[int, int]] = None


@dataclass
class KvfabricConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


class _Engine:
    """The agent and store shared by the connectors of one engine process."""

    def __init__(self, config: dict):
        self.agent = Agent(config)
        self.store = Store(self.agent, config)
        self.users = 0

    def close(self):
        self.store.close()
        self.agent.close()


_ENGINES: dict[str, _Engine] = {}


def _block_bytes(kv_cache_config, num_layers_hint: Optional[int] = None) -> Optional[int]:
    """Bytes of one block across every layer, from vLLM's KVCacheConfig shape."""
    try:
        group = kv_cache_config.kv_cache_groups[0]
        return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, IndexError, TypeError):
        return None


class KvfabricConnector(KVConnectorBase_V1):
    """kvfabric behind vLLM's KV connector interface.

    ``vllm_config.kv_transfer_config.kv_connector_extra_config["kvfabric"]`` holds the
    kvfabric config (``secret`` and ``name`` at least; ``etcd``/``nats`` for discovery and
    events); block size comes from ``vllm_config.cache_config.block_size`` and the block's
    bytes from ``kv_cache_config`` (or ``block_bytes`` in the kvfabric config).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        cfg = dict(extra.get("kvfabric", {}))
        self._block_size = int(vllm_config.cache_config.block_size)
        cfg["block_tokens"] = self._block_size
        if "block_bytes" not in cfg and "model" not in cfg:
            bb = _block_bytes(kv_cache_config)
            if bb is None:
                raise ValueError("kvfabric: set block_bytes, or pass a kv_cache_config")
            cfg["block_bytes"] = bb
        cfg.setdefault("serve", True)
        cfg.setdefault("remote", True)
        if "name" not in cfg:
            raise ValueError("kvfabric: the config needs a 'name' (one per engine process)")
        self._name = cfg["name"]
        engine = _ENGINES.get(self._name)
        if engine is None:
            engine = _ENGINES[self._name] = _Engine(cfg)
        engine.users += 1
        self._engine = engine
        # Scheduler-side state.
        self._lookups: dict[str, int] = {}  # req_id -> num_computed_tokens at lookup
        self._pending_loads: dict[str, tuple[int, int, list[int]]] = {}
        self._reqs: dict[str, ReqMeta] = {}  # tokens and blocks of running requests
        self._saved: dict[str, int] = {}  # req_id -> prompt blocks saved so far
        # Worker-side state.
        self._segments = None
        self._layers: list[str] = []
        self._loads: list[tuple[Any, ReqMeta]] = []
        self._layers_saved: set[str] = set()
        self._load_errors: set[int] = set()

    # ---------------------------------------------------------------- both sides

    @property
    def store(self) -> Store:
        return self._engine.store

    def node_info(self) -> bytes:
        """This engine's store as a fabric node, for other engines' :meth:`add_node`."""
        return self._engine.store.node_info()

    def add_node(self, info: bytes):
        """Uses another engine's store (its :meth:`node_info`) as a remote tier."""
        self._engine.store.add_node(info)

    def shutdown(self):
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.users -= 1
        if engine.users == 0:
            _ENGINES.pop(self._name, None)
            engine.close()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        """Registers each layer's paged buffer (numpy arrays or host torch tensors), in either
        of vLLM's layouts: K and V apart, ``[2, num_blocks, ...]`` (two segments per layer),
        or blocks first, ``[num_blocks, ...]`` (the CPU backend's ``[num_blocks, kv_heads,
        block_size, 2 * head_size]`` with K and V side by side; one segment per layer)."""
        parts = []
        agent = self._engine.agent
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for name, kv in kv_caches.items():
            shape = tuple(kv.shape)
            nbytes = int(kv.nbytes) if hasattr(kv, "nbytes") else int(kv.numel()) * int(kv.element_size())
            if len(shape) < 2:
                raise ValueError(f"{name}: a paged KV buffer has a block axis, got shape {shape}")
            k_v_apart = shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
            blocks_first = num_blocks is not None and shape[0] == num_blocks
            region = agent.register(kv, exported=False)
            if k_v_apart:
                n = shape[1]
                stride = nbytes // (2 * n)
                parts.append((region, 0, stride, stride))  # K
                parts.append((region, n * stride, stride, stride))  # V
            elif blocks_first or num_blocks is None:
                n = shape[0]
                stride = nbytes // n
                parts.append((region, 0, stride, stride))  # the block's K and V together
            else:
                raise ValueError(f"{name}: shape {shape} has no axis of {num_blocks} blocks")
            self._layers.append(name)
        total = sum(p[3] for p in parts)
        if total != self._engine.store.block_bytes:
            raise ValueError(f"kvfabric: a block is {total} bytes in these caches, {self._engine.store.block_bytes} in the store")
        self._segments = segments(parts)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for req in meta.requests:
            if req.load is None:
                continue
            first, n = req.load
            ids = req.block_ids[first:first + n]
            op = self._engine.store.load(req.token_ids, ids, self._segments, first_block=first)
            self._loads.append((op, req))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A kvfabric block carries every layer: the first wait completes all loads.
        loads, self._loads = self._loads, []
        for op, req in loads:
            first, n = req.load
            try:
                loaded = op.wait()
            except Exception:  # noqa: BLE001 - a failed load is reported per block
                loaded = 0
            finally:
                op.close()
            self._load_errors.update(req.block_ids[first + loaded:first + n])

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._layers_saved.add(layer_name)

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        missing = set(self._layers) - self._layers_saved
        self._layers_saved = set()
        if missing:
            # Blocks are whole across layers: never store a block with layers not written.
            return
        ops = []
        for req in meta.requests:
            if req.save is None:
                continue
            first, n = req.save
            ids = req.block_ids[first:first + n]
            ops.append(self._engine.store.save(req.token_ids, ids, self._segments, first_block=first))
        for op in ops:
            with op:
                op.wait()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        tokens = list(request.prompt_token_ids)
        bs = self._block_size
        hits = len(self._engine.store.lookup(tokens))
        # Whole blocks, and at least one prompt token left for the engine to compute.
        usable = min(hits, (len(tokens) - 1) // bs) * bs
        matched = usable - num_computed_tokens
        if matched <= 0:
            return 0, False
        self._lookups[request.request_id] = num_computed_tokens
        return matched, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        computed = self._lookups.pop(request.request_id, None)
        if num_external_tokens == 0 or computed is None:
            return
        bs = self._block_size
        block_ids = list(blocks.get_block_ids()[0])
        first, n = computed // bs, num_external_tokens // bs
        self._pending_loads[request.request_id] = (first, n, block_ids)

    def build_connector_meta(self, scheduler_output) -> KvfabricConnectorMetadata:
        meta = KvfabricConnectorMetadata()
        bs = self._block_size
        steps: list[tuple[ReqMeta, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            req = ReqMeta(new.req_id, list(new.prompt_token_ids), list(new.block_ids[0]))
            self._reqs[new.req_id] = req
            self._saved.setdefault(new.req_id, 0)
            pending = self._pending_loads.pop(new.req_id, None)
            if pending is not None:
                first, n, block_ids = pending
                req.block_ids = block_ids if len(block_ids) >= len(req.block_ids) else req.block_ids
                req.load = (first, n)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            steps.append((req, done))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            for i, rid in enumerate(cached.req_ids):
                req = self._reqs.get(rid)
                if req is None:
                    continue
                new_ids = cached.new_block_ids[i] if cached.new_block_ids else None
                if new_ids:
                    req.block_ids = req.block_ids + list(new_ids[0])
                done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
                req.load = None
                steps.append((req, done))
        for req, done in steps:
            # Full prompt blocks computed (or loaded) by the end of this step, not yet saved.
            full = min(done, len(req.token_ids)) // bs
            saved = self._saved.get(req.req_id, 0)
            step = ReqMeta(req.req_id, req.token_ids, req.block_ids, load=req.load)
            if full > saved:
                step.save = (saved, full - saved)
                self._saved[req.req_id] = full
            req.load = None
            if step.load or step.save:
                meta.requests.append(step)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._saved.pop(rid, None)
        self._lookups.pop(rid, None)
        self._pending_loads.pop(rid, None)
        # Saves finish within the step (wait_for_save): the blocks can be freed now.
        return False, None
