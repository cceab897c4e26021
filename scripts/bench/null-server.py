#!/usr/bin/env python3
"""A streaming OpenAI-style server that does no work at all: the ceiling that
`kvfabric bench serve` can reach on this machine, for the ratio in the serving benchmark.

GET /v1/models lists one model; POST /v1/completions (or /v1/chat/completions) answers
with `--chunks` fixed SSE chunks and a usage chunk, whatever the request says. Standard
library only.

    python3 scripts/bench/null-server.py --port 8100 &
    kvfabric bench serve --url http://127.0.0.1:8100 --concurrency 16 --requests 1000
"""
import argparse
import asyncio
import json


def sse(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def handle(reader, writer, chunks):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        if length:
            await reader.readexactly(length)
        if method == "GET" and path.endswith("/models"):
            body = json.dumps({"object": "list", "data": [{"id": "null", "object": "model"}]})
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode()
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            )
            for i in range(chunks):
                writer.write(sse({"object": "text_completion", "choices": [
                    {"index": 0, "text": " tok", "finish_reason": None}]}))
                await writer.drain()
            writer.write(sse({"object": "text_completion", "choices": [], "usage": {
                "prompt_tokens": 512, "completion_tokens": chunks, "total_tokens": 512 + chunks,
                "prompt_tokens_details": {"cached_tokens": 0}}}))
            writer.write(b"data: [DONE]\n\n")
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--chunks", type=int, default=64)
    a = ap.parse_args()
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, a.chunks), "127.0.0.1", a.port, backlog=4096)
    print(f"null server on http://127.0.0.1:{a.port}/v1", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
