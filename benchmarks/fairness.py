"""Fairness of `slimroute serve`: how long a 1-text request waits while a large request runs.

A client sends one request of --long-texts texts of about --long-tokens tokens each (distinct tickets joined), and
--delay seconds later another client sends a request of one ticket. Measured on a `slimroute serve` subprocess on
loopback: the short request's latency (and, for reference, the same request alone on an idle server) and the long
request's own time. Warm-up (a short and a long request) is excluded; the scenario runs --repeat times.

    python benchmarks/fairness.py --model smollm2-135m --json fairness.json
    python benchmarks/fairness.py --serve-flag=--max-gather-tokens=0      # extra `serve` flags, repeatable

Prints a table and one JSON record (also written to --json): settings, latencies, CPU, versions, git sha.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from harness import free_port, load_tickets, provenance, serve_command, start_server, stop_server, wait_ready


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--long-texts", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=2000, help="tokens per long text (at most --max-text-tokens)")
    p.add_argument("--delay", type=float, default=0.5, help="seconds between the long request and the short one")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flag", action="append", default=[], help="an extra `slimroute serve` flag (repeatable)")
    p.add_argument("--log", type=Path, default=None, help="the server's output (default: discarded)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.long_texts < 1 or args.long_tokens < 16 or args.delay < 0 or args.repeat < 1:
        p.error("--long-texts >= 1, --long-tokens >= 16, --delay >= 0, --repeat >= 1")
    return args


def long_texts(model: str, num: int, num_tokens: int, seed: int) -> tuple[list[str], list[str], list[int]]:
    """`num` texts of about `num_tokens` tokens (distinct tickets joined, cut at a token), a short ticket for the
    warm-up and one for the measure, and the long texts' token counts."""
    from transformers import AutoTokenizer

    from slimroute.runtime.load import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(model))
    tickets = [t["text"] for t in load_tickets(600)]
    rng = random.Random(seed)
    texts, counts = [], []
    for _ in range(num):
        rng.shuffle(tickets)
        ids: list[int] = []
        for ticket in tickets:
            ids += tokenizer(ticket + "\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= num_tokens:
                break
        text = tokenizer.decode(ids[:num_tokens]).strip()
        texts.append(text)
        counts.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    shorts = sorted(tickets[:50], key=len)[:2]
    return texts, shorts, counts


async def timed_post(client: httpx.AsyncClient, body: dict, after: float = 0.0) -> tuple[float, dict]:
    await asyncio.sleep(after)
    start = time.perf_counter()
    response = await client.post("/v1/classify", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"the server answered {response.status_code}: {response.text[:300]}")
    return seconds, response.json()


async def scenario(url: str, longs: list[str], short: str, delay: float) -> dict:
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        (long_s, _), (short_s, short_answer) = await asyncio.gather(
            timed_post(client, {"texts": longs}), timed_post(client, {"text": short}, delay))
    return {"short_s": short_s, "long_s": long_s, "short_timing": short_answer["timing"]}


async def alone(url: str, short: str, times: int = 3) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return statistics.median([(await timed_post(client, {"text": short}))[0] for _ in range(times)])


def main(argv=None) -> int:
    args = parse_args(argv)
    longs, (warm_short, short), counts = long_texts(args.model, args.long_texts, args.long_tokens, args.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(args.model, args.dtype, args.threads, port, *args.serve_flag)
    proc = start_server(command, log=args.log or Path("/dev/null"))
    try:
        wait_ready(url, proc)
        asyncio.run(alone(url, warm_short, 2))  # warm-up: a short request, then a long text
        httpx.post(f"{url}/v1/classify", json={"text": longs[0]}, timeout=600).raise_for_status()
        idle = asyncio.run(alone(url, short))
        runs = []
        for k in range(args.repeat):
            runs.append(asyncio.run(scenario(url, longs, short, args.delay)))
            print(f"run {k + 1}: short {runs[-1]['short_s']:.2f} s, long {runs[-1]['long_s']:.2f} s",
                  file=sys.stderr, flush=True)
    finally:
        stop_server(proc)
    record = {
        "benchmark": "fairness", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "serve_command": " ".join(command[3:]), "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "long_texts": args.long_texts, "long_text_tokens": counts, "delay_s": args.delay,
        "short_alone_s": round(idle, 3), "runs": [{k: (round(v, 3) if isinstance(v, float) else v)
                                                   for k, v in run.items()} for run in runs],
        "short_s_median": round(statistics.median(r["short_s"] for r in runs), 3),
        "long_s_median": round(statistics.median(r["long_s"] for r in runs), 3),
        **provenance(),
    }
    print(f"\n{args.model} {args.dtype}, {record['cpu_model']} ({record['cpu_count']} CPUs), a request of "
          f"{args.long_texts} x ~{round(statistics.mean(counts))} tokens, a 1-text request {args.delay} s after it")
    print("| measure | seconds |\n|---|---:|")
    print(f"| 1-text request alone (idle server, median of 3) | {idle:.2f} |")
    print(f"| 1-text request behind the long one (median of {len(runs)}) | {record['short_s_median']:.2f} |")
    print(f"| the long request itself (median of {len(runs)}) | {record['long_s_median']:.2f} |")
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
