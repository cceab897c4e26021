"""kvfabric behind vLLM's V1 KV connector interface (``KVConnectorBase_V1``).

Load it with (the installed package registers the name with vLLM: ``kvfabric.vllm_plugin``)::

    --kv-transfer-config '{"kv_connector": "KvfabricConnector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvfabric": {"name": "vllm-a", "secret": "..."}}}'

or, without installing it (a source tree on ``PYTHONPATH``), name the module too:
``"kv_connector_module_path": "kvfabric.vllm"``.

With vLLM installed the connector subclasses vLLM's base class; without it, stand-ins with
the same surface, so that engines (and tests) that own plain numpy buffers can drive it.

- Scheduler side (the engine core process): ``get_num_new_matched_tokens`` asks the
  instance's worker stores (:class:`kvfabric.connector.SchedulerLookup`) which leading run of
  the prompt they provide beyond vLLM's own prefix cache, in whole blocks, leaving one token
  to compute. ``update_state_after_alloc`` records the blocks that receive it;
  ``build_connector_meta`` hands each step's loads and saves (full prompt blocks computed by
  the end of the step) to the workers. ``request_finished`` keeps a request's blocks until
  its saves finished (``async_save``).
- Worker side (each worker process): ``register_kv_caches`` registers vLLM's KV tensors
  (host memory: the CPU backend's ``[num_blocks, kv_heads, block_size, 2 * head_size]`` or
  the ``[2, num_blocks, ...]`` layout) with a :class:`kvfabric.connector.WorkerStore`;
  ``start_load_kv`` starts the step's loads. With ``async_load`` (the default) a request
  with a hit waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` while its blocks load, other
  requests' steps running meanwhile, and ``get_finished`` reports it when its load ended;
  without it, the first ``wait_for_layer_load`` waits for the step's loads (a kvfabric block
  carries every layer, so layers cannot arrive one by one);
  ``wait_for_save`` starts the step's saves, after the forward pass wrote every layer, and
  returns without waiting for them; ``get_finished`` reports requests whose saves ended.
  Blocks that could not be loaded go to ``get_block_ids_with_load_errors`` and vLLM
  recomputes them (the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``
  unless the kvfabric config says ``"on_load_error": "fail"``).
- Metrics: ``get_kv_connector_stats`` feeds vLLM's periodic "KV Transfer metrics" log line.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from .connector import CONTROL_PLANE_COUNTERS, SchedulerLookup, Stats, WorkerStore

log = logging.getLogger("kvfabric.vllm")

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # type: ignore

    HAVE_VLLM = True
except ImportError:  # the stand-ins: same names and surface as vLLM's
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # noqa: B903
        """Scheduler -> worker metadata of one step."""

    @dataclass
    class KVConnectorStats:
        data: dict = field(default_factory=dict)

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
class KvfabricStats(KVConnectorStats):
    """The interval's counters of every worker (summed)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        # Counts add up (over workers and intervals); a contact age is the longest.
        for k, v in (other.data or {}).items():
            if k.endswith("_age_s"):
                self.data[k] = max(self.data.get(k, 0.0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        # Worker counters only: the scheduler's lookups show in vLLM's own "External prefix
        # cache hit rate".
        d = {k: v for k, v in self.data.items() if not k.startswith(("lookup", "cp_"))}
        secs = d.pop("load_seconds", 0.0)
        n = d.get("loaded_blocks", 0)
        if n:
            d["load_ms_per_block"] = round(1000.0 * secs / n, 3)
        # The control plane, when something went wrong with it in the interval.
        for c in control_plane_components(self.data):
            down = self.data[f"cp_{c}_workers"] - self.data.get(f"cp_{c}_up", 0)
            if down:
                d[f"{c}_unreachable_reports"] = down
            for k in CONTROL_PLANE_COUNTERS:
                if self.data.get(f"cp_{c}_{k}"):
                    d[f"{c}_{k}"] = self.data[f"cp_{c}_{k}"]
        return d

    def is_empty(self) -> bool:
        return not any(self.reduce().values())


def control_plane_components(data: dict) -> list:
    """The control-plane components (etcd, nats) reported in stats data."""
    return sorted(k[3:-8] for k in data if k.startswith("cp_") and k.endswith("_workers"))


class KvfabricPromMetrics:
    """The connector's metrics in vLLM's ``/metrics``: the control plane as the worker stores
    see it, named as kvfabric's own processes name it (``kvfabric_control_plane_up`` and the
    rest, with vLLM's model and engine labels and ``component``). ``observe`` takes each
    step's stats, summed over the workers."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        gauge = _metric_class(metric_types, "Gauge")
        counter = _metric_class(metric_types, "Counter")
        names = list(labelnames) + ["component"]
        self._labelvalues = per_engine_labelvalues
        self._up = gauge(
            name="kvfabric_control_plane_up",
            documentation="1 while every worker store of the engine reaches the component.",
            multiprocess_mode="mostrecent",
            labelnames=names,
        )
        self._age = gauge(
            name="kvfabric_control_plane_contact_age_seconds",
            documentation="Seconds since a worker store last reached the component (longest).",
            multiprocess_mode="mostrecent",
            labelnames=names,
        )
        self._counters = {
            k: counter(name=f"kvfabric_control_plane_{k}", documentation=doc, labelnames=names)
            for k, doc in (
                ("reconnects", "Times a worker store's connection to the component came back."),
                ("lease_renewals_failed", "Discovery lease renewals that failed."),
                ("events_dropped", "Events the bus dropped before a worker store read them."),
            )
        }

    def observe(self, data: dict, engine_idx: int = 0):
        labels = list(self._labelvalues.get(engine_idx, []))
        for c in control_plane_components(data or {}):
            up = data.get(f"cp_{c}_up", 0) == data[f"cp_{c}_workers"]
            self._up.labels(*labels, c).set(1 if up else 0)
            self._age.labels(*labels, c).set(data.get(f"cp_{c}_contact_age_s", 0.0))
            for k, m in self._counters.items():
                n = data.get(f"cp_{c}_{k}", 0)
                if n:
                    m.labels(*labels, c).inc(n)


def _metric_class(metric_types: dict, name: str):
    """vLLM's class for prometheus_client's ``name`` in ``metric_types`` (keyed by the
    prometheus_client classes)."""
    for base, cls in metric_types.items():
        if getattr(base, "__name__", "") == name:
            return cls
    raise KeyError(name)


@dataclass
class ReqMeta:
    """What the worker does for one request in one step."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    # (first logical block, number of blocks) to load / to save, or None.
    load: Optional[tuple[int, int]] = None
    save: Optional[tuple[int, int]] = None
    # The load runs while the request waits in WAITING_FOR_REMOTE_KVS (get_finished reports
    # its end) rather than within the step.
    load_async: bool = False
    # vLLM's per-request ``cache_salt``: the request's blocks are named in its tenant's own
    # namespace, in the store as in vLLM's own prefix cache.
    salt: Optional[str] = None


@dataclass
class KvfabricConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


def _block_bytes(kv_cache_config) -> Optional[int]:
    """Bytes of one block across every layer, from vLLM's KVCacheConfig."""
    try:
        group = kv_cache_config.kv_cache_groups[0]
        return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, IndexError, TypeError):
        return None


def _parallel(vllm_config) -> tuple[int, int, str]:
    """(rank, world size, instance suffix) of this process in the instance."""
    pc = getattr(vllm_config, "parallel_config", None)
    rank = int(getattr(pc, "rank", 0) or 0)
    world = int(getattr(pc, "world_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_size", 1) or 1)
    suffix = f"-dp{int(getattr(pc, 'data_parallel_rank', 0) or 0)}" if dp > 1 else ""
    return rank, world, suffix


class KvfabricConnector(KVConnectorBase_V1):
    """kvfabric behind vLLM's KV connector interface.

    ``kv_connector_extra_config["kvfabric"]`` holds the kvfabric config (``secret`` and
    ``name`` at least; ``etcd``/``nats`` for discovery and events; see
    :mod:`kvfabric.connector`); block size comes from ``cache_config.block_size`` and the
    block's bytes from ``kv_cache_config`` (or ``block_bytes`` in the kvfabric config).
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
        if "name" not in cfg:
            raise ValueError("kvfabric: the config needs a 'name' (one per engine instance)")
        rank, world, suffix = _parallel(vllm_config)
        cfg["name"] = f"{cfg['name']}{suffix}"
        self._worker: Optional[WorkerStore] = None
        self._lookup: Optional[SchedulerLookup] = None
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerStore(cfg, rank=rank)
        else:
            self._lookup = SchedulerLookup(cfg, self._block_size, world_size=world)
            self._async_save = str(cfg.get("async_save", True)).lower() not in ("0", "false", "no", "off")
            self._async_load = str(cfg.get("async_load", True)).lower() not in ("0", "false", "no", "off")
            if self._async_load and HAVE_VLLM and not hasattr(KVConnectorBase_V1, "update_connector_output"):
                # A vLLM before update_connector_output never says a load ended to the
                # scheduler side: load within the step there.
                log.info("kvfabric: this vLLM has no update_connector_output; loads run in the step")
                self._async_load = False
            if str(cfg.get("on_load_error", "recompute")) == "recompute":
                try:
                    vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
                except (AttributeError, TypeError, ValueError):
                    pass
        # Scheduler-side state.
        self._lookups: dict[str, int] = {}  # req_id -> num_computed_tokens at lookup
        self._pending_loads: dict[str, tuple[int, int, list[int]]] = {}
        self._reqs: dict[str, ReqMeta] = {}  # tokens and blocks of running requests
        self._saved: dict[str, int] = {}  # req_id -> prompt blocks saved so far
        self._salts: dict[str, str] = {}  # req_id -> its cache_salt, for those with one
        # Asynchronous loads: allocated, not yet handed to the workers (req_id -> the
        # request's load), and handed to them, not yet reported finished.
        self._async_pending: dict[str, ReqMeta] = {}
        self._async_loading: set[str] = set()
        # The blocks each live request loads, and the requests whose load failed: vLLM
        # recomputes a failed load's blocks, and when it truncates the request back to no
        # computed tokens it looks the request up again. Offering the same blocks again
        # would fail the same way, forever: a request whose load failed computes its prompt.
        self._loading_blocks: dict[str, set[int]] = {}
        self._load_failed: set[str] = set()
        # Worker-side state.
        self._layers: list[str] = []
        self._loads: list[tuple[Any, ReqMeta]] = []
        self._async_loads: dict[str, tuple[Any, ReqMeta]] = {}  # req_id -> (handle, load)
        self._load_errors: set[int] = set()
        self._saving: set[str] = set()  # requests with saves, not reported finished yet
        self._finishing: set[str] = set()  # of those, finished in the engine

    # ---------------------------------------------------------------- both sides

    @property
    def worker_store(self) -> WorkerStore:
        if self._worker is None:
            raise RuntimeError("kvfabric: the store lives on the worker side")
        return self._worker

    @property
    def stats(self) -> Stats:
        return (self._worker or self._lookup).stats

    def node_info(self) -> bytes:
        """This worker's store as a fabric node, for other stores' :meth:`add_node`."""
        return self.worker_store.node_info()

    def add_node(self, info: bytes):
        """Uses another store (its :meth:`node_info`) as a fabric node of the remote tier."""
        self.worker_store.add_node(info)

    def shutdown(self):
        worker, self._worker = self._worker, None
        lookup, self._lookup = self._lookup, None
        if worker is not None:
            worker.close()
        if lookup is not None:
            lookup.close()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvfabricStats(data=dict(data or {}))

    def get_kv_connector_stats(self):
        if self._worker is None:
            return None
        data = self._worker.stats.take_interval()
        # With etcd or NATS, every step reports their state (the gauges follow it).
        cp = self._worker.control_plane()
        if not any(data.values()) and not cp:
            return None
        data.update(cp)
        return KvfabricStats(data=data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """kvfabric's metrics in vLLM's ``/metrics`` (``KvfabricPromMetrics``)."""
        return KvfabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        """Registers each layer's paged buffer (numpy arrays, host or CUDA torch tensors), in either
        of vLLM's layouts: K and V apart, ``[2, num_blocks, ...]`` (two pieces per layer), or
        blocks first, ``[num_blocks, ...]`` (the CPU backend's ``[num_blocks, kv_heads,
        block_size, 2 * head_size]``; one piece per layer)."""
        parts = []
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for name, kv in kv_caches.items():
            shape = tuple(kv.shape)
            nbytes = int(kv.nbytes) if hasattr(kv, "nbytes") else int(kv.numel()) * int(kv.element_size())
            if len(shape) < 2:
                raise ValueError(f"{name}: a paged KV buffer has a block axis, got shape {shape}")
            k_v_apart = shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
            blocks_first = num_blocks is not None and shape[0] == num_blocks
            if k_v_apart:
                n = shape[1]
                stride = nbytes // (2 * n)
                parts.append((kv, 0, stride, stride))  # K
                parts.append((kv, n * stride, stride, stride))  # V
            elif blocks_first or num_blocks is None:
                stride = nbytes // shape[0]
                parts.append((kv, 0, stride, stride))  # the block's K and V together
            else:
                raise ValueError(f"{name}: shape {shape} has no axis of {num_blocks} blocks")
            self._layers.append(name)
        # GPU tensors register as GPU memory (saves and loads copy D2H and H2D on kvfabric's
        # stream); the engine's stream is synchronised before a save reads them.
        self._gpu = any(getattr(getattr(p[0], "device", None), "type", "cpu") == "cuda" for p in parts)
        self.worker_store.register(parts)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for req in meta.requests:
            if req.load is None:
                continue
            first, n = req.load
            ids = req.block_ids[first:first + n]
            handle = self.worker_store.start_load(req.token_ids, first, ids, salt=req.salt)
            if req.load_async:
                self._async_loads[req.req_id] = (handle, req)
            else:
                self._loads.append((handle, req))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A kvfabric block carries every layer: the first wait completes all loads.
        loads, self._loads = self._loads, []
        for handle, req in loads:
            first, n = req.load
            loaded = self.worker_store.finish_load(handle, n)
            self._load_errors.update(req.block_ids[first + loaded:first + n])

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        # Blocks are saved whole, across layers, once the forward pass wrote them all.
        pass

    def wait_for_save(self):
        # Called after the forward pass: every layer of the step's blocks is written (on a
        # GPU, once the engine's stream has run it).
        meta = self._get_connector_metadata()
        if getattr(self, "_gpu", False) and any(r.save is not None for r in meta.requests):  # pragma: no cover - GPU
            import torch

            torch.cuda.current_stream().synchronize()
        for req in meta.requests:
            if req.save is None:
                continue
            first, n = req.save
            self.worker_store.save(req.req_id, req.token_ids, first, req.block_ids[first:first + n],
                                   salt=req.salt)
            if self.worker_store.async_save:
                self._saving.add(req.req_id)

    def _loads_done(self) -> set[str]:
        """Requests whose asynchronous loads ended (blocks that did not arrive are load
        errors, which vLLM recomputes)."""
        done = set()
        for rid, (handle, req) in list(self._async_loads.items()):
            if handle is not None and not handle[0].done():
                continue
            del self._async_loads[rid]
            first, n = req.load
            loaded = self.worker_store.finish_load(handle, n)
            self._load_errors.update(req.block_ids[first + loaded:first + n])
            done.add(rid)
        return done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        worker = self.worker_store
        recving = self._loads_done()
        # The scheduler delays freeing a request's blocks when it scheduled a save for it;
        # the worker saw that save in the same step's metadata.
        self._finishing |= set(finished_req_ids) & self._saving
        done = worker.saves_done(self._finishing)
        self._finishing -= done
        self._saving -= done
        # Collect the saves of running requests as they end (errors counted early).
        worker.saves_done(self._saving - self._finishing)
        return (done or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        salt = getattr(request, "cache_salt", None)
        if salt:
            self._salts[request.request_id] = str(salt)
        if request.request_id in self._load_failed:
            return 0, False
        matched = self._lookup.matched_tokens(list(request.prompt_token_ids), num_computed_tokens, salt=salt)
        if matched <= 0:
            return 0, False
        self._lookups[request.request_id] = num_computed_tokens
        return matched, self._async_load

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        computed = self._lookups.pop(request.request_id, None)
        if num_external_tokens == 0 or computed is None:
            return
        bs = self._block_size
        block_ids = list(blocks.get_block_ids()[0])
        first, n = computed // bs, num_external_tokens // bs
        self._loading_blocks[request.request_id] = set(block_ids[first:first + n])
        if self._async_load:
            # The request waits for its blocks: the load goes to the workers in this step's
            # metadata, without the request being scheduled.
            tokens = list(request.prompt_token_ids)
            self._async_pending[request.request_id] = ReqMeta(
                request.request_id, tokens, block_ids, load=(first, n), load_async=True,
                salt=self._salts.get(request.request_id),
            )
            return
        self._pending_loads[request.request_id] = (first, n, block_ids)

    def build_connector_meta(self, scheduler_output) -> KvfabricConnectorMetadata:
        meta = KvfabricConnectorMetadata()
        bs = self._block_size
        # vLLM schedules a request that waited for its blocks only after the workers reported
        # the load finished: a scheduled request loads nothing any more, whether or not this
        # vLLM passed the report to update_connector_output.
        for rid in self._scheduled_ids(scheduler_output):
            self._async_loading.discard(rid)
        for rid, load in self._async_pending.items():
            meta.requests.append(load)
            self._async_loading.add(rid)
        self._async_pending.clear()
        steps: list[tuple[ReqMeta, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            req = ReqMeta(new.req_id, list(new.prompt_token_ids), list(new.block_ids[0]),
                          salt=self._salts.get(new.req_id))
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
            # A request resumed after preemption has new blocks that replace its old ones
            # (vLLM 0.32: resumed_req_ids; older: resumed_from_preemption per request).
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            flags = getattr(cached, "resumed_from_preemption", None) or ()
            resumed |= {rid for rid, f in zip(cached.req_ids, flags) if f}
            for i, rid in enumerate(cached.req_ids):
                req = self._reqs.get(rid)
                if req is None:
                    continue
                new_ids = cached.new_block_ids[i] if cached.new_block_ids else None
                if new_ids:
                    ids = list(new_ids[0])
                    req.block_ids = ids if rid in resumed else req.block_ids + ids
                req.load = None
                # A resumed request is looked up again: its hit is loaded like a new one's.
                pending = self._pending_loads.pop(rid, None)
                if pending is not None:
                    first, n, block_ids = pending
                    req.block_ids = block_ids if len(block_ids) >= len(req.block_ids) else req.block_ids
                    req.load = (first, n)
                done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
                steps.append((req, done))
        for req, done in steps:
            # Full prompt blocks computed (or loaded) by the end of this step, not yet saved.
            full = min(done, len(req.token_ids)) // bs
            saved = self._saved.get(req.req_id, 0)
            step = ReqMeta(req.req_id, req.token_ids, req.block_ids, load=req.load, salt=req.salt)
            if full > saved:
                step.save = (saved, full - saved)
                self._saved[req.req_id] = full
            req.load = None
            if step.load or step.save:
                meta.requests.append(step)
        return meta

    @staticmethod
    def _scheduled_ids(scheduler_output):
        ids = [new.req_id for new in scheduler_output.scheduled_new_reqs]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            ids.extend(cached.req_ids)
        return ids

    def update_connector_output(self, connector_output) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:
            for rid, blocks in self._loading_blocks.items():
                if blocks & invalid and rid not in self._load_failed:
                    self._load_failed.add(rid)
                    self._lookup.stats.add(load_failed_requests=1)
        # Loads the workers reported finished no longer hold their blocks.
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._async_loading.discard(rid)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        saved = self._saved.pop(rid, 0)
        self._salts.pop(rid, None)
        self._lookups.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._loading_blocks.pop(rid, None)
        self._load_failed.discard(rid)
        # A load not handed to the workers yet never starts.
        self._async_pending.pop(rid, None)
        # With asynchronous saves, the blocks stay allocated until the workers report the
        # request in get_finished (its saves read them); a request aborted while its blocks
        # load, until the workers report the load ended (it writes them).
        loading = rid in self._async_loading
        return (self._async_save and saved > 0) or loading, None
