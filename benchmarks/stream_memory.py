"""Peak RSS of `slimroute classify` on small and large inputs: streaming keeps memory flat.

Each size runs the real CLI in its own process on a tiny random model (tests/tiny.py), and the
process's peak RSS comes from the kernel (its VmHWM, read while it runs: wait4's ru_maxrss would
start at this parent's own peak, which holds torch and the tiny model too). Prints one JSON record per run and a table.

    flock /tmp/slimroute-heavy.lock python benchmarks/stream_memory.py --rows 5000 100000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from slimroute.bench.speed import peak_rss_bytes
from slimroute.io.durable import progress_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def write_input(path: Path, num_rows: int, max_chars: int) -> None:
    """num_rows seeded synthetic tickets (a pool of 5000 texts reused under fresh ids), streamed to disk."""
    from slimroute.io.synth import synthetic_tickets

    pool = synthetic_tickets(5000, seed=0)
    with path.open("w", encoding="utf-8") as f:
        for i in range(num_rows):
            ticket = pool[i % len(pool)]
            record = {"id": f"r{i:07d}", "text": ticket["text"][:max_chars], "label": ticket["label"]}
            f.write(json.dumps(record) + "\n")


def save_tiny_model(folder: Path) -> None:
    from tiny import tiny_model

    model, tokenizer = tiny_model("qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run_one(src: Path, model: Path, out: Path, window: int, threads: int, cli_args: list[str]) -> dict:
    command = [sys.executable, "-m", "slimroute.cli", "classify", str(src),
               "--labels", "billing,technical,account", "--model", str(model), "--out", str(out),
               "--window", str(window), "--threads", str(threads),
               "--summary-json", str(out.with_suffix(".summary.json")), *cli_args]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []  # (rows committed, RSS MiB) twice a second: flat after the first windows
    peak = 0
    while proc.poll() is None:
        peak = max(peak, peak_rss_bytes(proc.pid))
        with contextlib.suppress(psutil.Error, OSError, ValueError, KeyError):
            rss = psutil.Process(proc.pid).memory_info().rss / 2**20
            samples.append((json.loads(progress_path(out).read_text())["rows_done"], round(rss, 1)))
        time.sleep(0.5)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"classify failed: {' '.join(command)}")
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    halfway = [rss for rows, rss in samples if rows >= summary["items"] // 2]
    return {"rows": summary["items"], "peak_rss_mib": round(peak / 2**20, 1),
            "rss_mib_at_half": halfway[0] if halfway else None,
            "rss_mib_last": samples[-1][1] if samples else None,
            "wall_s": round(seconds, 1), "items_per_s": summary["items_per_s"], "window": window,
            "threads": threads, "cli_args": " ".join(cli_args)}


def versions() -> dict:
    import torch
    import transformers

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "git_sha": git("rev-parse", "--short", "HEAD") or None,
            "dirty_tree": bool(git("status", "--porcelain", "--untracked-files=no"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[5000, 100_000])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-chars", type=int, default=160, help="Cut texts to this length (speed).")
    parser.add_argument("--cli-args", default="", help="Extra classify flags, e.g. '--max-padding 0'.")
    parser.add_argument("--json", type=Path, help="Also append the records to this JSONL file.")
    args = parser.parse_args()
    info = versions()
    records = []
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as tmp:
        tmp = Path(tmp)
        save_tiny_model(tmp / "model")
        for num_rows in args.rows:
            src = tmp / f"in-{num_rows}.jsonl"
            write_input(src, num_rows, args.max_chars)
            out = tmp / f"out-{num_rows}.jsonl"
            record = {**run_one(src, tmp / "model", out, args.window, args.threads, shlex.split(args.cli_args)),
                      "input_mib": round(src.stat().st_size / 2**20, 1), "max_chars": args.max_chars, **info}
            records.append(record)
            print(json.dumps(record), flush=True)
            src.unlink()
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    base = records[0]["peak_rss_mib"]
    print(f"\n{'rows':>9} {'input MiB':>10} {'peak RSS MiB':>13} {'vs first':>9} {'RSS half-way':>13} "
          f"{'RSS last':>9} {'items/s':>8} {'wall s':>7}")
    for r in records:
        growth = r["peak_rss_mib"] / base - 1
        print(f"{r['rows']:>9} {r['input_mib']:>10} {r['peak_rss_mib']:>13} {growth:>+9.1%} "
              f"{r['rss_mib_at_half'] or '-':>13} {r['rss_mib_last'] or '-':>9} {r['items_per_s']:>8.0f} "
              f"{r['wall_s']:>7}")


if __name__ == "__main__":
    main()
