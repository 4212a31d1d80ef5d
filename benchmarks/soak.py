"""Soak test for `slimroute serve`: minutes of overload mixed with bad requests, on loopback only.

1. capacity and offline answers: `engine.classify` on the tickets in this process gives the capacity
   (items/s) and each ticket's answer; with --capacity the answers come from the server at low load instead;
2. `slimroute serve` in a subprocess on 127.0.0.1 with an API key (passed in the environment, not on the
   command line) and a small --max-queue, so that overload shows as 503s rather than as minutes of queue;
3. for --seconds (or --max-requests): --clients closed-loop clients (one request in flight each) paced
   together at --overload x capacity items/s, beside --bad-clients sending, at --bad-share of that rate,
   malformed JSON, oversized bodies (Content-Length and chunked), slow bodies (trickled over seconds), wrong
   and missing keys, and requests abandoned while queued or mid-body;
4. the load stops (requests still open are abandoned, as clients that go away); then the time until a
   fresh request gets its normal answer;
5. the server's RSS at start (ready), after --warmup-seconds of load and at the end.

Every 200 answer is compared with the offline answer for its text. Prints a Markdown table and one JSON
record (also written to --json).

    nice -n 10 python benchmarks/soak.py --seconds 180 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import secrets
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from harness import (
    free_port,
    load_tickets,
    measure_offline,
    metric_by_label,
    metric_sum,
    percentile,
    provenance,
    serve_command,
    start_server,
    stop_server,
    wait_ready,
)

BAD_KINDS = ("malformed_json", "oversized", "oversized_chunked", "slow_body", "wrong_key", "missing_key",
             "gone_while_queued", "gone_mid_body")
MAX_BODY_BYTES = 1 << 20  # the server's default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: physical cores)")
    p.add_argument("--host", default="127.0.0.1", help="only 127.0.0.1: the soak never leaves this machine")
    p.add_argument("--n", type=int, default=300, help="distinct tickets (at most 600), reused during the soak")
    p.add_argument("--seconds", type=float, default=180.0, help="length of the load phase")
    p.add_argument("--max-requests", type=int, default=100_000, help="cap on requests sent in the load phase")
    p.add_argument("--warmup-seconds", type=float, default=30.0, help="RSS growth is counted from here")
    p.add_argument("--capacity", type=float, default=None, help="items/s; default: measured offline first")
    p.add_argument("--overload", type=float, default=3.0, help="offered good items/s over the capacity")
    p.add_argument("--clients", type=int, default=128, help="closed-loop clients sending good requests")
    p.add_argument("--bad-clients", type=int, default=8)
    p.add_argument("--bad-share", type=float, default=0.25, help="bad requests per good request sent")
    p.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue (texts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.host != "127.0.0.1":
        p.error(f"--host must be 127.0.0.1 (the soak only runs on loopback), got {args.host!r}")
    if not 1 <= args.n <= 600 or not 1 <= args.clients <= 1024 or not 0 <= args.bad_clients <= 256:
        p.error("--n must be 1..600, --clients 1..1024, --bad-clients 0..256")
    if args.seconds <= 0 or args.overload <= 0 or args.max_requests < 1 or args.bad_share < 0:
        p.error("--seconds, --overload and --max-requests must be positive, --bad-share >= 0")
    return args


class Pacer:
    """Hands out send slots at `rate` per second across all the clients sharing it; no catching up after
    a stall (a slot missed because every client was waiting is lost, as with real clients)."""

    def __init__(self, rate: float):
        self.interval, self.next = 1.0 / rate, time.monotonic()

    async def wait(self, cost: int = 1) -> None:
        now = time.monotonic()
        slot = max(self.next, now)
        self.next = slot + cost * self.interval
        await asyncio.sleep(slot - now)


class Tally:
    """What came back: status per request kind, 200 latencies, 503s with Retry-After, answers vs offline."""

    def __init__(self, offline: list[dict]):
        self.offline = offline  # ticket index -> {"label", "logprobs"}
        self.statuses: Counter = Counter()  # (kind, status or "no answer: ...") -> requests
        self.latencies: list[float] = []
        self.items_ok = self.wrong = self.retry_after = self.busy = 0
        self.max_diff = 0.0

    def record(self, kind: str, response: httpx.Response | None, indices=(), latency=0.0, failure=None) -> None:
        if response is None:
            self.statuses[(kind, f"no answer: {failure}")] += 1
            return
        self.statuses[(kind, response.status_code)] += 1
        if response.status_code == 503:
            self.busy += 1
            self.retry_after += response.headers.get("retry-after", "").isdigit()
        if response.status_code == 200:
            self.latencies.append(latency)
            for index, item in zip(indices, response.json()["results"], strict=True):
                want = self.offline[index]
                diff = max(abs(want["logprobs"][k] - v) for k, v in item["logprobs"].items())
                self.wrong += item["label"] != want["label"] or diff > 1e-4
                self.max_diff = max(self.max_diff, diff)
                self.items_ok += 1


def classify_body(tickets: list[dict], indices: list[int]) -> bytes:
    if len(indices) == 1:
        return json.dumps({"text": tickets[indices[0]]["text"]}).encode()
    return json.dumps({"texts": [tickets[i]["text"] for i in indices], "ids": list(indices)}).encode()


async def trickle(data: bytes, pieces: int, seconds: float):
    step = math.ceil(len(data) / pieces)
    for start in range(0, len(data), step):
        yield data[start : start + step]
        await asyncio.sleep(seconds / pieces)


async def post(client, tally: Tally, kind: str, content, headers: dict, indices=(), timeout: float = 300.0):
    sent = time.perf_counter()
    try:
        response = await client.post("/v1/classify", content=content, headers=headers, timeout=timeout)
    except httpx.TransportError as exc:
        return tally.record(kind, None, failure=type(exc).__name__)
    tally.record(kind, response, indices, time.perf_counter() - sent)


async def bad_request(client, tally: Tally, kind: str, tickets: list[dict], rng: random.Random, key: str):
    json_type = {"content-type": "application/json"}
    auth = {**json_type, "Authorization": f"Bearer {key}"}
    body = classify_body(tickets, [rng.randrange(len(tickets))])
    if kind == "malformed_json":
        await post(client, tally, kind, body[: len(body) // 2], auth)
    elif kind == "oversized":
        await post(client, tally, kind, b'{"text": "' + b"x" * MAX_BODY_BYTES + b'"}', auth)
    elif kind == "oversized_chunked":
        await post(client, tally, kind, trickle(b'{"text": "' + b"y" * (MAX_BODY_BYTES + 4096) + b'"}', 20, 0.2),
                   auth)
    elif kind == "slow_body":  # a valid request whose body takes 4 s to arrive; its answer is checked too
        index = rng.randrange(len(tickets))
        await post(client, tally, kind, trickle(classify_body(tickets, [index]), 8, 4.0), auth, [index])
    elif kind in ("wrong_key", "missing_key"):
        headers = {**json_type, "Authorization": f"Bearer {secrets.token_urlsafe(24)}"} if kind == "wrong_key" \
            else json_type
        await post(client, tally, kind, body, headers)
    elif kind == "gone_while_queued":  # gives up after 0.5 s: queued requests are dropped by the server
        await post(client, tally, kind, body, auth, timeout=0.5)
    else:  # gone_mid_body: half the body, then the connection closes
        try:
            await asyncio.wait_for(post(client, tally, kind, trickle(body, 8, 4.0), auth), 2.0)
        except TimeoutError:
            tally.record(kind, None, failure="client left mid-body")


async def soak(url: str, args, tickets: list[dict], tally: Tally, capacity: float, key: str, proc_rss) -> dict:
    rng = random.Random(args.seed)
    auth = {"content-type": "application/json", "Authorization": f"Bearer {key}"}
    good_pacer = Pacer(args.overload * capacity)
    bad_pacer = Pacer(max(args.bad_share * args.overload * capacity, 1e-6))
    start, sent, rss = time.monotonic(), Counter(), {}

    def running() -> bool:
        return time.monotonic() - start < args.seconds and sum(sent.values()) < args.max_requests

    async def good_client(client, seed):
        local = random.Random(seed)
        while running():
            indices = [local.randrange(len(tickets)) for _ in range(4 if local.random() < 0.125 else 1)]
            await good_pacer.wait(len(indices))
            sent["good"] += 1
            await post(client, tally, "good" if len(indices) == 1 else "good_4_texts",
                       classify_body(tickets, indices), auth, indices)

    async def bad_client(client, seed):
        local = random.Random(seed)
        while running():
            await bad_pacer.wait()
            kind = local.choice(BAD_KINDS)
            sent[kind] += 1
            await bad_request(client, tally, kind, tickets, local, key)

    async def watch_rss():
        while True:
            elapsed = time.monotonic() - start
            rss.setdefault("samples", []).append((round(elapsed, 1), proc_rss()))
            if elapsed >= args.warmup_seconds and "warm" not in rss:
                rss["warm"] = proc_rss()
            await asyncio.sleep(1.0)

    # idle connections are closed by the client after 2 s, before the server's keep-alive timeout (5 s): else a
    # request sent on a connection the server is closing at that moment fails (ReadError), a client artefact
    good = httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=args.clients, keepalive_expiry=2))
    bad = httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=max(1, args.bad_clients),
                                                              keepalive_expiry=2))
    cpu = time.process_time()
    tasks = [asyncio.ensure_future(good_client(good, rng.random())) for _ in range(args.clients)]
    tasks += [asyncio.ensure_future(bad_client(bad, rng.random())) for _ in range(args.bad_clients)]
    watcher = asyncio.ensure_future(watch_rss())
    while running() and not all(t.done() for t in tasks):
        await asyncio.sleep(0.2)
    seconds = time.monotonic() - start
    for task in [*tasks, watcher]:  # the load stops: open requests are abandoned
        task.cancel()
    await asyncio.gather(*tasks, watcher, return_exceptions=True)
    await good.aclose()
    await bad.aclose()
    stopped = time.monotonic()
    recovery = await back_to_normal(url, tickets, tally.offline, auth, stopped)
    return {"seconds": seconds, "sent": dict(sent), "rss": rss, "recovery": recovery,
            "client_cpu_s": time.process_time() - cpu}


async def back_to_normal(url: str, tickets: list[dict], offline: list[dict], auth: dict, stopped: float) -> dict:
    """Seconds from the end of the load to the first correct 200, then the latency of 5 single requests."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        attempts, index, first = 0, 0, None
        while first is None and time.monotonic() - stopped < 120:
            attempts += 1
            index = (index + 1) % len(tickets)
            response = await client.post("/v1/classify", content=classify_body(tickets, [index]), headers=auth)
            if response.status_code == 200 and response.json()["results"][0]["label"] == offline[index]["label"]:
                first = time.monotonic() - stopped
            else:
                await asyncio.sleep(0.1)
        latencies = []
        for index in range(5):
            sent = time.perf_counter()
            response = await client.post("/v1/classify", content=classify_body(tickets, [index]), headers=auth)
            latencies.append(time.perf_counter() - sent if response.status_code == 200 else math.inf)
    return {"seconds_to_first_normal_answer": first, "attempts": attempts, "latencies_after_s": latencies}


async def single_latencies(url: str, tickets: list[dict], auth: dict, n: int = 5) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        out = []
        for index in range(n):
            sent = time.perf_counter()
            response = await client.post("/v1/classify", content=classify_body(tickets, [index]), headers=auth)
            response.raise_for_status()
            out.append(time.perf_counter() - sent)
    return out


def answers_through_server(url: str, tickets: list[dict], key: str) -> list[dict]:
    """Each ticket's answer from the idle server, 32 per request (used when --capacity skips the offline run)."""
    from slimroute.backends.remote import RemoteClassifier

    with RemoteClassifier(url, chunk_size=32, concurrency=1, api_key=key) as clf:
        predictions = clf.classify([t["text"] for t in tickets])
    return [{"label": p.label, "logprobs": p.logprobs} for p in predictions]


def main(argv=None) -> int:
    args = parse_args(argv)
    tickets = load_tickets(args.n)
    offline, capacity = None, args.capacity
    if capacity is None:
        record, predictions = measure_offline(args.model, args.dtype, args.threads, [t["text"] for t in tickets])
        offline = [{"label": p.label, "logprobs": p.logprobs} for p in predictions]
        capacity = record["items_per_s"]
    key, port = secrets.token_urlsafe(32), free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(args.model, args.dtype, args.threads, port, "--max-queue", str(args.max_queue))
    log = Path(tempfile.mkdtemp(prefix="slimroute-soak-")) / "server.log"
    proc = start_server(command, env={"SLIMROUTE_API_KEY": key}, log=log)
    server = psutil.Process(proc.pid)
    auth = {"content-type": "application/json", "Authorization": f"Bearer {key}"}
    try:
        wait_ready(url, proc)
        rss_start = server.memory_info().rss
        if offline is None:
            offline = answers_through_server(url, tickets, key)
        before = asyncio.run(single_latencies(url, tickets, auth))
        tally = Tally(offline)
        result = asyncio.run(soak(url, args, tickets, tally, capacity, key, lambda: server.memory_info().rss))
        rss_end = server.memory_info().rss
        metrics = httpx.get(f"{url}/metrics", headers=auth).text
    finally:
        exit_code = stop_server(proc)
    server_log = log.read_text(errors="replace")
    record = build_record(args, capacity, tally, result, before, metrics, rss_start, rss_end, exit_code, server_log,
                          key)
    print(markdown(record))
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    return 0 if all(record["targets_met"].values()) else 1


def build_record(args, capacity, tally, result, before, metrics, rss_start, rss_end, exit_code, server_log,
                 key) -> dict:
    statuses = Counter()
    for (_, status), n in tally.statuses.items():
        statuses[str(status)] += n
    by_kind: dict[str, dict] = {}
    for (kind, status), n in sorted(tally.statuses.items(), key=str):
        by_kind.setdefault(kind, {})[str(status)] = n
    other_5xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500 and s != "503")
    rss_warm = result["rss"].get("warm", rss_end)
    growth = (rss_end - rss_warm) / rss_warm
    seconds = result["seconds"]
    good_items = sum(n * (4 if k == "good_4_texts" else 1) for (k, s), n in tally.statuses.items()
                     if k.startswith("good"))
    recovery = result["recovery"]["seconds_to_first_normal_answer"]
    lat = tally.latencies or [math.nan]
    record = {
        "benchmark": "soak", "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "model": args.model, "dtype": args.dtype, "threads": args.threads, "seconds": round(seconds, 1),
        "clients": args.clients, "bad_clients": args.bad_clients, "max_queue": args.max_queue,
        "capacity_items_per_s": capacity, "capacity_from": "argument" if args.capacity else "offline engine.classify",
        "offered_good_items_per_s": round(good_items / seconds, 2),
        "offered_over_capacity": round(good_items / seconds / capacity, 2),
        "answered_items_per_s": round(tally.items_ok / seconds, 2),
        "offered_over_answered": round(good_items / max(tally.items_ok, 1), 2), "requests_sent": result["sent"],
        "statuses": dict(statuses), "by_kind": by_kind, "other_5xx": other_5xx,
        "busy_503": tally.busy, "busy_503_with_retry_after": tally.retry_after,
        "accepted": len(tally.latencies), "accepted_p50_s": round(percentile(lat, 0.5), 3),
        "accepted_p99_s": round(percentile(lat, 0.99), 3), "answers_checked": tally.items_ok,
        "wrong_answers": tally.wrong, "max_abs_logprob_diff": tally.max_diff,
        "rss_mb": {"start": rss_start >> 20, "after_warmup": rss_warm >> 20, "end": rss_end >> 20,
                   "max": max((r for _, r in result["rss"].get("samples", [])), default=rss_end) >> 20},
        "rss_growth_after_warmup": round(growth, 4), "warmup_seconds": args.warmup_seconds,
        "single_latency_before_s": [round(x, 3) for x in before],
        "recovery": result["recovery"], "client_cpu_s": round(result["client_cpu_s"], 1),
        "server": {  # the server's own counts (status 499: the client had gone)
            "requests_by_status": metric_by_label(metrics, "slimroute_requests_total", "status"),
            "errors_by_kind": metric_by_label(metrics, "slimroute_errors_total", "kind"),
            "dropped_requests": int(metric_sum(metrics, "slimroute_dropped_requests_total")),
            "unauthorized_requests": int(metric_sum(metrics, "slimroute_unauthorized_requests_total"))},
        "server_exit_code": exit_code, "server_log_tracebacks": server_log.count("Traceback"),
        "key_in_server_log": key in server_log,
        **provenance(),
    }
    server_5xx = sum(n for s, n in record["server"]["requests_by_status"].items() if int(s) >= 500 and s != "503")
    record["targets_met"] = {
        "no 5xx but 503": other_5xx == 0 and server_5xx == 0 and not record["server_log_tracebacks"],
        "503s carry Retry-After": tally.retry_after == tally.busy,
        "RSS growth after warm-up <= 10%": growth <= 0.10,
        "0 wrong answers": tally.wrong == 0,
        "normal answers within 5 s after the load": recovery is not None and recovery <= 5.0,
        "no key in the server log": not record["key_in_server_log"],
    }
    return record


def markdown(r: dict) -> str:
    statuses = sorted({s for kind in r["by_kind"].values() for s in kind}, key=lambda s: (not s.isdigit(), s))
    lines = [f"`{r['command']}`", "", "| request kind | sent | " + " | ".join(statuses) + " |",
             "|---|---:|" + "---:|" * len(statuses)]
    for kind, counts in r["by_kind"].items():
        lines.append(f"| {kind} | {sum(counts.values())} | " + " | ".join(str(counts.get(s, "")) for s in statuses)
                     + " |")
    rss, rec, met = r["rss_mb"], r["recovery"], r["targets_met"]
    after = " / ".join(f"{x:.2f}" for x in rec["latencies_after_s"])
    first = rec["seconds_to_first_normal_answer"]
    lines += ["", "| measure | value | target |", "|---|---|---|",
              f"| load | {r['seconds']:.0f} s; good traffic {r['offered_good_items_per_s']} items/s = "
              f"**{r['offered_over_capacity']}x** the capacity ({r['capacity_items_per_s']} items/s, "
              f"{r['capacity_from']}); answered {r['answered_items_per_s']} items/s (offered / answered: "
              f"{r['offered_over_answered']}x) | 2-3x |",
              f"| 5xx other than 503 | {r['other_5xx']} (server tracebacks: {r['server_log_tracebacks']}) | 0 "
              f"{'✓' if met['no 5xx but 503'] else '✗'} |",
              f"| 503 with Retry-After | {r['busy_503_with_retry_after']} of {r['busy_503']} | all "
              f"{'✓' if met['503s carry Retry-After'] else '✗'} |",
              f"| accepted (200) latency p50 / p99 | {r['accepted_p50_s']:.2f} / {r['accepted_p99_s']:.2f} s "
              f"({r['accepted']} requests) | - |",
              f"| answers ≠ offline | {r['wrong_answers']} of {r['answers_checked']} (max abs. log-prob diff "
              f"{r['max_abs_logprob_diff']:.1e}) | 0 {'✓' if met['0 wrong answers'] else '✗'} |",
              f"| server RSS start / after warm-up ({r['warmup_seconds']:.0f} s) / end (max) | {rss['start']} / "
              f"{rss['after_warmup']} / {rss['end']} MiB ({rss['max']}); growth after warm-up "
              f"{100 * r['rss_growth_after_warmup']:+.1f}% | ≤ 10% "
              f"{'✓' if met['RSS growth after warm-up <= 10%'] else '✗'} |",
              f"| first normal answer after the load stops | {'-' if first is None else f'{first:.2f} s'} "
              f"(then single requests: {after} s) | ≤ 5 s "
              f"{'✓' if met['normal answers within 5 s after the load'] else '✗'} |",
              f"| key in the server's log | {'yes' if r['key_in_server_log'] else 'no'} | no |"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
