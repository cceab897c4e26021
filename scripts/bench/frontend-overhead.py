"""TTFT through kvfabric's frontend against the engine directly: the same token-id prompts
(256 tokens, 8 out, streamed), the same load (concurrency 1 and 4, 300 requests, two rounds).

    python3 scripts/bench/frontend-overhead.py ENGINE_HOST:PORT FRONTEND_HOST:PORT

The engine serves the model "fast" and is attached to the frontend (`kvfabric attach --model
fast ...`); serving/attach/tests/engines/fake_engine.py --model fast --prefill-us 0 --decode-us 0 is
the zero-delay stand-in used for docs/engines.md.
"""
import json, random, socket, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

def ttft(host, port, body):
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    buf = b""; first = None
    while True:
        c = s.recv(65536)
        if not c: break
        buf += c
        if first is None and b"data: {" in buf: first = time.perf_counter() - t0
        if b"[DONE]" in buf: break
    s.close()
    return first

def run(host, port, model, conc, n, seed):
    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": [rng.randrange(1000, 40000) for _ in range(256)], "max_tokens": 8,
               "stream": True} for _ in range(n)]
    with ThreadPoolExecutor(conc) as ex:
        ts = sorted(x * 1000 for x in ex.map(lambda b: ttft(host, port, b), bodies) if x is not None)
    q = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))]
    return q(0.5), q(0.99)

direct, front = sys.argv[1], sys.argv[2]
for conc in (1, 4):
    for rnd in range(2):
        d = run(*direct.split(":"), "fast", conc, 300, 100 + rnd)
        f = run(*front.split(":"), "fast", conc, 300, 200 + rnd)
        print(f"c={conc} round {rnd}: direct p50/p99 {d[0]:.2f}/{d[1]:.2f} ms   frontend {f[0]:.2f}/{f[1]:.2f} ms")
