"""A small engine that behaves like vLLM at its edges, for kvfabric's end-to-end tests.

What it does as vLLM does: an OpenAI-compatible HTTP server (`/v1/completions` with the
prompt as token ids, streaming or not, `usage.prompt_tokens_details.cached_tokens`;
`/v1/models`, `/health`, `/metrics` with vLLM's metric names), a prefix cache of full blocks
with LRU eviction, and KV events in vLLM's format over ZeroMQ (`kv_events.Publisher`): a
`BlockStored` for each new chain of full blocks, `BlockRemoved` (before it, same batch) for
what the chain evicted.

With `--scheduling-policy priority` it takes vLLM's `priority` field (lower first) and
computes one prompt at a time, the waiting ones in priority order, then arrival; without it,
a request with a non-zero `priority` is refused with 400, as vLLM refuses one, and prompts
are computed concurrently. `/metrics` counts the requests of each priority
(`fake:requests_by_priority_total{priority}`).

What it cannot prove: anything about vLLM's scheduler, its attention, its real block hashes
(sha256 of the engine's own key; here sha256 of the parent hash and the tokens), its timing,
or that the text it generates means anything (token t is the word "t<t>").
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kv_events import Publisher


class PrefixCache:
    def __init__(self, block_size: int, capacity: int, publisher: Publisher):
        self.bs = block_size
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pub = publisher
        self.lock = threading.Lock()

    @staticmethod
    def hash(parent: int | None, tokens: list[int]) -> int:
        d = hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()
        return int.from_bytes(d[:8], "little")

    def serve(self, prompt: list[int]) -> int:
        """Admits a prompt: returns its cached tokens; stores its new full blocks."""
        with self.lock:
            parent = None
            cached = 0
            new_hashes, new_tokens, new_parent = [], [], None
            for i in range(len(prompt) // self.bs):
                toks = prompt[i * self.bs:(i + 1) * self.bs]
                h = self.hash(parent, toks)
                if h in self.blocks and not new_hashes:
                    self.blocks.move_to_end(h)
                    cached += self.bs
                else:
                    if not new_hashes:
                        new_parent = parent
                    new_hashes.append(h)
                    new_tokens += toks
                parent = h
            if not new_hashes:
                return cached
            events = []
            evicted = []
            while len(self.blocks) + len(new_hashes) > self.capacity and self.blocks:
                evicted.append(self.blocks.popitem(last=False)[0])
            for h in evicted:
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"})
            for h in new_hashes:
                self.blocks[h] = None
            events.append({
                "type": "BlockStored", "block_hashes": new_hashes,
                "parent_block_hash": new_parent, "token_ids": new_tokens,
                "block_size": self.bs, "medium": "GPU",
            })
            self.pub.publish(events)
            return cached


class Engine:
    def __init__(self, args, publisher):
        self.args = args
        self.cache = PrefixCache(args.block_size, args.capacity, publisher)
        self.running = 0
        self.lock = threading.Lock()
        self.prompt_tokens_sum = 0
        self.requests = 0
        self.by_priority: dict[int, int] = {}
        # --scheduling-policy priority: one prompt computed at a time, the waiting ones by
        # (priority, arrival).
        self.prefill_busy = False
        self.prefill_queue: list[tuple[int, int]] = []
        self.prefill_cv = threading.Condition()
        self.arrivals = itertools.count()

    def prefill(self, priority: int, seconds: float):
        if self.args.scheduling_policy != "priority":
            time.sleep(seconds)
            return
        me = (priority, next(self.arrivals))
        with self.prefill_cv:
            heapq.heappush(self.prefill_queue, me)
            while self.prefill_busy or self.prefill_queue[0] != me:
                self.prefill_cv.wait()
            heapq.heappop(self.prefill_queue)
            self.prefill_busy = True
        try:
            time.sleep(seconds)
        finally:
            with self.prefill_cv:
                self.prefill_busy = False
                self.prefill_cv.notify_all()


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send_json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": engine.args.model}]})
            elif self.path == "/metrics":
                with engine.lock:
                    text = (
                        f'vllm:num_requests_running{{model_name="{engine.args.model}"}} {engine.running}\n'
                        f'vllm:num_requests_waiting{{model_name="{engine.args.model}"}} 0\n'
                        f'vllm:kv_cache_usage_perc{{model_name="{engine.args.model}"}} '
                        f'{len(engine.cache.blocks) / engine.cache.capacity}\n'
                        f'vllm:cache_config_info{{block_size="{engine.args.block_size}",'
                        f'num_gpu_blocks="{engine.cache.capacity}"}} 1.0\n'
                        f"vllm:request_prompt_tokens_sum {engine.prompt_tokens_sum}\n"
                        f"vllm:request_prompt_tokens_count {engine.requests}\n"
                    ) + "".join(
                        f'fake:requests_by_priority_total{{priority="{p}"}} {n}\n'
                        for p, n in sorted(engine.by_priority.items())
                    )
                    text = text.encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self.send_json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            n = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(n) or b"{}")
            if self.path != "/v1/completions":
                return self.send_json(404, {"error": {"message": "not found"}})
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                # Text (a benchmark client talking to the engine directly): one token per byte.
                prompt = list(prompt.encode())
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                return self.send_json(400, {"error": {"message": "prompt must be token ids"}})
            if body.get("model") != engine.args.model:
                return self.send_json(404, {"error": {"message": f"model {body.get('model')!r}"}})
            priority = body.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                return self.send_json(400, {"error": {"message": "priority must be an integer"}})
            if priority != 0 and engine.args.scheduling_policy != "priority":
                return self.send_json(400, {"error": {
                    "message": "Got priority != 0 but the scheduling policy is not priority"}})
            with engine.lock:
                engine.running += 1
                engine.requests += 1
                engine.prompt_tokens_sum += len(prompt)
                engine.by_priority[priority] = engine.by_priority.get(priority, 0) + 1
            try:
                cached = engine.cache.serve(prompt)
                # Prefill time for the tokens not cached.
                engine.prefill(priority, (len(prompt) - cached) * engine.args.prefill_us / 1e6)
                max_tokens = int(body.get("max_tokens") or 16)
                out = [(prompt[-1] + i + 1) % 1000 for i in range(max_tokens)]
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(out),
                    "total_tokens": len(prompt) + len(out),
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                if not body.get("stream"):
                    text = "".join(f" t{t}" for t in out)
                    return self.send_json(200, {
                        "id": "cmpl-fake", "object": "text_completion", "model": engine.args.model,
                        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                        "usage": usage,
                    })
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()

                def chunk(obj):
                    data = f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                for i, t in enumerate(out):
                    time.sleep(engine.args.decode_us / 1e6)
                    finish = "length" if i == len(out) - 1 else None
                    chunk({"id": "cmpl-fake", "object": "text_completion",
                           "choices": [{"index": 0, "text": f" t{t}", "finish_reason": finish}],
                           "usage": None})
                if (body.get("stream_options") or {}).get("include_usage"):
                    chunk({"id": "cmpl-fake", "object": "text_completion", "choices": [],
                           "usage": usage})
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            finally:
                with engine.lock:
                    engine.running -= 1

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fake")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=256, help="blocks in the prefix cache")
    ap.add_argument("--prefill-us", type=float, default=50.0, help="per uncached prompt token")
    ap.add_argument("--decode-us", type=float, default=500.0, help="per generated token")
    ap.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    ap.add_argument("--pub", default="tcp://127.0.0.1:*")
    ap.add_argument("--replay", default="tcp://127.0.0.1:*")
    a = ap.parse_args()
    publisher = Publisher("vllm", a.pub, a.replay, topic="kv", bind=True)
    engine = Engine(a, publisher)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(engine))
    server.daemon_threads = True
    print(json.dumps({"http": f"http://127.0.0.1:{server.server_address[1]}",
                      "pub": publisher.pub_endpoint, "replay": publisher.replay_endpoint}),
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
