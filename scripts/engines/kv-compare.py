"""Compares KV layers in real vLLM instances, all up at once, by time to first token
(scripts/engines/lmcache-compare.sh starts them). Each system is a pair of instances, A and
B, that share KV through their layer. Every round draws a new prompt of random token ids and
runs it through each system in turn (the order alternates between rounds, so drift in the
machine's speed falls on every system alike):

- compute: A computes it (the layer only saves);
- remote:  B loads what A computed;
- host:    B again, after vLLM's own prefix cache was reset (the layer's host memory);
- disk:    A, after its prefix cache was reset, the prompt of --disk-lag rounds ago, which
           the layer's small host memory no longer holds (its disk).

Then, per system, B streams a long decode while it loads prompts A computed: how long the
decode's tokens wait during the loads (the longest gap is what a running user sees). Greedy
outputs are compared per system across its tiers and computing, and computing across
systems; the exit code says whether the first system's were identical everywhere.
Standard library only.

  python3 kv-compare.py --system kvfabric=http://127.0.0.1:8110,http://127.0.0.1:8111 \\
      --system lmcache=http://127.0.0.1:8112,http://127.0.0.1:8113 --model M --rounds 12
"""

import argparse
import json
import random
import statistics
import sys
import threading
import time

from vllm_http import complete, reset, token_times

ROWS = [
    ("compute", "A computes the prompt"),
    ("host", "host tier after a prefix-cache reset"),
    ("disk", "disk tier"),
    ("remote", "instance B loads what A computed"),
]


def decode_gaps(a, b, model, prompts, decode_tokens):
    """B decodes while it loads `prompts` (computed on A first): B's token gaps that overlap
    a load, and the loads' times to first token."""
    for p in prompts:
        complete(a, model, p, 1)
    time.sleep(1.0)  # saves end in the background
    arrivals, windows, ttfts = [], [], []
    decode = threading.Thread(target=token_times, args=(b, model, [9, 10, 11], decode_tokens, arrivals))
    decode.start()
    while len(arrivals) < 20 and decode.is_alive():
        time.sleep(0.01)
    for p in prompts:
        time.sleep(0.3)
        t0 = time.perf_counter()
        ttft, _, _ = complete(b, model, p, 1)
        windows.append((t0, time.perf_counter()))
        ttfts.append(ttft)
    decode.join()
    inside, outside = [], []
    for t_prev, t in zip(arrivals[1:], arrivals[2:]):
        hit = any(t > w0 and t_prev < w1 for w0, w1 in windows)
        (inside if hit else outside).append(t - t_prev)
    return inside, outside, ttfts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", action="append", required=True,
                    help="NAME=A_URL,B_URL (repeat; the first is the one the others are compared to)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--disk-lag", type=int, default=4,
                    help="the disk row asks for the prompt of this many rounds ago")
    ap.add_argument("--stall-prompts", type=int, default=3)
    ap.add_argument("--stall-decode", type=int, default=400)
    ap.add_argument("--json", help="also write the raw times here")
    args = ap.parse_args()
    systems = []
    for s in args.system:
        name, _, urls = s.partition("=")
        a, _, b = urls.partition(",")
        if not (name and a and b):
            ap.error(f"--system {s!r}: want NAME=A_URL,B_URL")
        systems.append((name, a.rstrip("/"), b.rstrip("/")))
    # Warm up every path before measuring: first requests compile (a long prefill too) and
    # allocate; a layer's first load connects.
    wrng = random.Random(3)
    for _, a, b in systems:
        complete(a, args.model, [5, 6, 7], 2)
        complete(b, args.model, [5, 6, 7], 2)
        warm = [wrng.randrange(100, 40000) for _ in range(args.tokens)]
        complete(a, args.model, warm, 2)
        time.sleep(1.0)
        complete(b, args.model, warm, 2)
        reset(b)
        complete(b, args.model, warm, 2)
    times = {name: {row: [] for row, _ in ROWS} for name, _, _ in systems}
    cached = {name: {row: [] for row, _ in ROWS} for name, _, _ in systems}
    texts = {}  # round -> every output of its prompt, across systems and tiers
    rng = random.Random(7)
    prompts = []
    for r in range(args.rounds):
        prompts.append([rng.randrange(100, 40000) for _ in range(args.tokens)])
        order = systems if r % 2 == 0 else systems[::-1]
        for name, a, b in order:
            def run(row, base, prompt_round):
                t, text, c = complete(base, args.model, prompts[prompt_round])
                times[name][row].append(t)
                cached[name][row].append(c)
                texts.setdefault(prompt_round, []).append((name, row, text))
                return t
            line = [f"round {r:2} {name:<10}"]
            line.append(f"compute {run('compute', a, r):.3f}")
            time.sleep(1.0)  # saves end in the background
            line.append(f"remote {run('remote', b, r):.3f}")
            reset(b)
            line.append(f"host {run('host', b, r):.3f}")
            if r >= args.disk_lag:
                reset(a)
                line.append(f"disk {run('disk', a, r - args.disk_lag):.3f}")
            print("  ".join(line), flush=True)
    gaps = {}
    srng = random.Random(11)
    for i, (name, a, b) in enumerate(systems):
        stall = [[srng.randrange(100, 40000) for _ in range(args.tokens)]
                 for _ in range(args.stall_prompts)]
        gaps[name] = decode_gaps(a, b, args.model, stall, args.stall_decode)
        inside, outside, _ = gaps[name]
        print(f"decode on B of {name}: {len(inside)} gaps during loads, max "
              f"{max(inside, default=0) * 1e3:.1f} ms; outside p50 "
              f"{statistics.median(outside) * 1e3 if outside else 0:.1f} ms", flush=True)

    first = systems[0][0]
    print()
    print("time to first token, median s (n); the last columns: the first system's median "
          "over each other's")
    head = f"{'row':<40}" + "".join(f"{n:>18}" for n, _, _ in systems)
    head += "".join(f"{first + '/' + n:>20}" for n, _, _ in systems[1:])
    print(head)
    for row, label in ROWS:
        cells = []
        for n, _, _ in systems:
            v = times[n][row]
            cells.append(f"{statistics.median(v):>12.3f} ({len(v):>2})" if v else f"{'-':>18}")
        ratios = []
        for n, _, _ in systems[1:]:
            mine, theirs = times[first][row], times[n][row]
            ratios.append(f"{statistics.median(mine) / statistics.median(theirs):>20.2f}"
                          if mine and theirs else f"{'-':>20}")
        print(f"{label:<40}" + "".join(cells) + "".join(ratios))
    cells, ratios = [], []
    for n, _, _ in systems:
        inside = gaps[n][0]
        cells.append(f"{max(inside) * 1e3:>12.1f} ms ({len(inside)})" if inside else f"{'-':>18}")
    for n, _, _ in systems[1:]:
        if gaps[first][0] and gaps[n][0]:
            ratios.append(f"{max(gaps[first][0]) / max(gaps[n][0]):>20.2f}")
        else:
            ratios.append(f"{'-':>20}")
    print(f"{'longest decode gap during loads':<40}" + "".join(cells) + "".join(ratios))
    print()
    print("cached prompt tokens vLLM reported, median:",
          {n: {row: statistics.median([c for c in v if c is not None] or [0])
               for row, v in cached[n].items() if v} for n, _, _ in systems})
    # Greedy outputs: every tier of a system must give what computing gives; computing must
    # agree across systems (same model, same vLLM).
    per_system = {n: all(len({t for m, _, t in outs if m == n}) == 1 for outs in texts.values())
                  for n, _, _ in systems}
    computed = all(len({t for _, row, t in outs if row == "compute"}) == 1
                   for outs in texts.values())
    for n, ok in per_system.items():
        print(f"greedy output of {n} identical across its tiers and computing: {ok}")
    print("computed output identical across systems:", computed)
    for r, outs in sorted(texts.items()):
        if len({t for _, _, t in outs}) > 1:
            print(f"  round {r}:", [(n, row, t[:30]) for n, row, t in outs])
    same = per_system[first] and computed
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": times, "cached": cached,
                       "decode_gaps_during_loads": {n: g[0] for n, g in gaps.items()},
                       "decode_gaps_outside": {n: g[1] for n, g in gaps.items()},
                       "tokens": args.tokens, "rounds": args.rounds}, f, indent=1)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
