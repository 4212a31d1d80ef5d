"""Load test for `slimroute serve`: N concurrent clients sending single tickets over loopback.

Measures, in one run on the same machine, dtype and engine config (that of `slimroute classify`):
  1. offline throughput: `engine.classify` on all the tickets at once (warm-up excluded);
  2. server throughput and latency: `slimroute serve` in a subprocess, --clients concurrent clients
     each sending one ticket per request until --n tickets are answered (or --max-seconds pass);
  3. offline throughput again: the ratio uses the mean of the run before and the run after, since
     other work on a shared machine moves both.
Every server answer is compared with the offline answer for the same ticket.

    flock /tmp/slimroute-heavy.lock python benchmarks/load.py --n 300 --clients 32

Prints a table and one JSON record (also written to --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from harness import (
    free_port,
    load_tickets,
    measure_offline,
    metric_sum,
    percentile,
    provenance,
    serve_command,
    start_server,
    stop_server,
    wait_ready,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--n", type=int, default=300, help="tickets (at most 600)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512, help="engine token budget (0: none)")
    p.add_argument("--max-padding", type=float, default=0.0, help="engine padding cap (0: none)")
    p.add_argument("--max-gather-tokens", type=int, default=8192, help="server gather cap (0: none)")
    p.add_argument("--max-wait-ms", type=float, default=50.0)
    p.add_argument("--max-seconds", type=float, default=900.0, help="cap on the load phase")
    p.add_argument("--skip-offline", action="store_true", help="only the server part")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 1 <= args.n <= 600 or not 1 <= args.clients <= 256:
        p.error("--n must be 1..600 and --clients 1..256")
    return args


async def run_load(url: str, tickets: list[dict], clients: int, max_seconds: float) -> dict:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=max_seconds, limits=limits) as client:
        warm = tickets[:clients]  # warm-up: one round, not timed
        await asyncio.gather(*(client.post("/v1/classify", json={"text": t["text"]}) for t in warm))
        next_index, latencies, answers, statuses = 0, [], {}, {}
        start, client_cpu = time.perf_counter(), time.process_time()

        async def one_client():
            nonlocal next_index
            while next_index < len(tickets) and time.perf_counter() - start < max_seconds:
                ticket = tickets[next_index]
                next_index += 1
                sent = time.perf_counter()
                body = {"text": ticket["text"], "id": ticket["id"]}
                response = await client.post("/v1/classify", json=body)
                latencies.append(time.perf_counter() - sent)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    answers[ticket["id"]] = response.json()["results"][0]

        await asyncio.gather(*(one_client() for _ in range(clients)))
        seconds = time.perf_counter() - start
        client_cpu = time.process_time() - client_cpu
        metrics = (await client.get("/metrics")).text
    return {"seconds": seconds, "latencies": latencies, "answers": answers, "statuses": statuses,
            "metrics": metrics, "client_cpu_s": client_cpu}


def main(argv=None) -> int:
    args = parse_args(argv)
    tickets = load_tickets(args.n)
    texts = [t["text"] for t in tickets]
    engine_args = (args.batch_size, args.max_batch_tokens, args.max_padding)
    before, offline_preds = (None, None) if args.skip_offline else measure_offline(
        args.model, args.dtype, args.threads, texts, *engine_args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(serve_command(
        args.model, args.dtype, args.threads, port, "--batch-size", str(args.batch_size),
        "--max-padding", str(args.max_padding), "--max-gather-tokens", str(args.max_gather_tokens),
        "--max-wait-ms", str(args.max_wait_ms), "--max-batch-tokens", str(args.max_batch_tokens)))
    try:
        wait_ready(url, proc)
        load = asyncio.run(run_load(url, tickets, args.clients, args.max_seconds))
    finally:
        stop_server(proc)
    offline = None
    if before is not None:
        after, _ = measure_offline(args.model, args.dtype, args.threads, texts, *engine_args)
        runs = [before["items_per_s"], after["items_per_s"]]
        offline = {**before, "items_per_s": round(sum(runs) / 2, 3), "runs_items_per_s": runs}
    done = len(load["answers"])
    throughput = done / load["seconds"]
    lat = load["latencies"]
    mismatches = max_diff = None
    if offline_preds is not None:
        by_id = {t["id"]: p for t, p in zip(tickets, offline_preds, strict=True)}
        mismatches = sum(by_id[i].label != a["label"] for i, a in load["answers"].items())
        max_diff = max((abs(by_id[i].logprobs[k] - v) for i, a in load["answers"].items()
                        for k, v in a["logprobs"].items()), default=0.0)
    num_batches = metric_sum(load["metrics"], "slimroute_batch_items_count")
    real = metric_sum(load["metrics"], "slimroute_real_tokens_total")
    processed = metric_sum(load["metrics"], "slimroute_processed_tokens_total")
    record = {
        "benchmark": "load", "model": args.model, "dtype": args.dtype, "n": args.n, "clients": args.clients,
        "batch_size": args.batch_size, "max_batch_tokens": args.max_batch_tokens, "max_padding": args.max_padding,
        "max_gather_tokens": args.max_gather_tokens, "max_wait_ms": args.max_wait_ms,
        "answered": done, "statuses": {str(k): v for k, v in load["statuses"].items()},
        "server_items_per_s": round(throughput, 3), "seconds": round(load["seconds"], 2),
        "p50_s": round(percentile(lat, 0.5), 3), "p95_s": round(percentile(lat, 0.95), 3),
        "p99_s": round(percentile(lat, 0.99), 3),
        "mean_batch_items": round((metric_sum(load["metrics"], "slimroute_batch_items_sum")) / num_batches, 2)
        if num_batches else None,
        "server_padding_overhead": round(1 - real / processed, 4) if processed else None,
        # engine time / wall time of the load phase (warm-up round included in the engine time)
        "engine_busy": round(metric_sum(load["metrics"], "slimroute_batch_seconds_sum") / load["seconds"], 3),
        "client_cpu_s": round(load["client_cpu_s"], 2),  # the load generator's own CPU time on this machine
        "offline": offline, "label_mismatches_vs_offline": mismatches, "max_abs_logprob_diff": max_diff,
        **provenance(),
    }
    record["ratio_server_vs_offline"] = round(throughput / offline["items_per_s"], 3) if offline else None
    print_table(record)
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


def print_table(r: dict) -> None:
    rows = [("answered", f"{r['answered']} of {r['n']} ({r['statuses']})"),
            ("server throughput", f"{r['server_items_per_s']:.2f} items/s ({r['clients']} clients)"),
            ("latency p50 / p95 / p99", f"{r['p50_s']:.2f} / {r['p95_s']:.2f} / {r['p99_s']:.2f} s"),
            ("mean batch", f"{r['mean_batch_items']} items, padding {r['server_padding_overhead']}"),
            ("engine busy / client CPU", f"{100 * r['engine_busy']:.0f}% of the wall time / {r['client_cpu_s']:.1f} s")]
    if r["offline"]:
        runs = " / ".join(f"{x:.2f}" for x in r["offline"]["runs_items_per_s"])
        rows.append(("offline engine.classify", f"{r['offline']['items_per_s']:.2f} items/s (before / after: {runs})"))
        rows.append(("server / offline", f"{r['ratio_server_vs_offline']:.2f}"))
    if r["label_mismatches_vs_offline"] is not None:
        rows.append(("labels differing from offline", str(r["label_mismatches_vs_offline"])))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
