"""What the server benchmarks (load.py, soak.py) share: the tickets, the offline engine run, a
`slimroute serve` subprocess on loopback, percentiles, Prometheus sums, and the run's provenance."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "tickets-600.jsonl"
LABELS = "billing,technical,account"


def load_tickets(n: int) -> list[dict]:
    if SAMPLE.is_file():
        with open(SAMPLE, encoding="utf-8") as f:
            tickets = [json.loads(line) for line in f if line.strip()]
    else:
        from slimroute.io.synth import synthetic_tickets

        tickets = synthetic_tickets(600, 0)
    return tickets[:n]


def measure_offline(model: str, dtype: str, threads: int | None, texts: list[str], batch_size: int = 32,
                    max_batch_tokens: int = 512, max_padding: float = 0.0) -> tuple[dict, list]:
    """`engine.classify` on all the texts at once, in this process (warm-up excluded): (record, predictions)."""
    import slimroute

    config = slimroute.EngineConfig(batch_size=batch_size, max_batch_tokens=max_batch_tokens or None,
                                    max_padding=max_padding or None)
    router = slimroute.load(model, LABELS, dtype=dtype, threads=threads, config=config)
    engine, loaded = router.engine, router.loaded
    engine.classify(texts[:8])  # warm-up
    start = time.perf_counter()
    predictions = engine.classify(texts)
    seconds = time.perf_counter() - start
    record = {"items_per_s": round(len(texts) / seconds, 3), "seconds": round(seconds, 2),
              "padding_overhead": round(engine.last_stats.padding.overhead, 4), "threads": loaded.threads}
    print(f"offline: {len(texts) / seconds:.2f} items/s", file=sys.stderr, flush=True)
    del engine, loaded, router
    gc.collect()
    return record, predictions


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model: str, dtype: str, threads: int | None, port: int, *flags: str) -> list[str]:
    """`slimroute serve` on 127.0.0.1:port with the bench's labels, as a command line."""
    command = [sys.executable, "-m", "slimroute.cli", "serve", "--model", model, "--dtype", dtype,
               "--labels", LABELS, "--host", "127.0.0.1", "--port", str(port), *flags]
    return command + (["--threads", str(threads)] if threads else [])


def start_server(command: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """The server's output goes to `log` (else to this process's terminal)."""
    out = open(log, "wb") if log else None  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=out,
                            stderr=subprocess.STDOUT if out else None)
    proc.log_file = out
    return proc


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def stop_server(proc: subprocess.Popen, timeout: float = 120.0) -> int | None:
    """SIGTERM, wait, else SIGKILL; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if getattr(proc, "log_file", None):
        proc.log_file.close()
    return proc.returncode


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples in Prometheus text, over those carrying `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def metric_by_label(text: str, name: str, label: str) -> dict[str, int]:
    """A counter's samples in Prometheus text, summed per value of one label: {"200": 12, "503": 3}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for s in (s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name):
        out[s.labels[label]] = out.get(s.labels[label], 0) + int(s.value)
    return out


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict:
    """git sha, CPU, package versions: what a benchmark record needs to be compared with another."""
    import fastapi
    import torch
    import transformers
    import uvicorn

    return {"git_sha": git_sha(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "fastapi": fastapi.__version__,
                         "uvicorn": uvicorn.__version__, "httpx": httpx.__version__}}
