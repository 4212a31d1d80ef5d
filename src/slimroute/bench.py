"""`slimroute bench`: the seed experiment on this machine, every technique alone and combined.

Each row classifies the same tickets, is timed without its warm-up, and is checked against the
reference run in the same dtype (label agreement, max |Δ log-prob|). Results go to a JSON record
(machine, threads, versions, git sha) and a Markdown table; --plot adds a PNG bar chart.
"""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from slimroute.config import EngineConfig
from slimroute.data import synthetic_tickets
from slimroute.engine import Engine
from slimroute.kernels import set_linear_kernels
from slimroute.labels import Prediction
from slimroute.models import load_model
from slimroute.reference import ReferenceClassifier
from slimroute.task import Example, Task, encode, render_prompt
from slimroute.verify import compare

LABELS = ("billing", "technical", "account")
FEW_SHOT = (  # two short labelled examples per label, kept in the cached prefix
    Example("I was charged twice for my subscription this month, please refund one payment.", "billing"),
    Example("The invoice shows the wrong amount and my card was billed early.", "billing"),
    Example("The app crashes with error 500 every time I open the dashboard.", "technical"),
    Example("Sync stopped working after the last update and pages load forever.", "technical"),
    Example("I need to change the email address on my profile and reset my password.", "account"),
    Example("Please close my account and delete my user data.", "account"),
)


@dataclass
class Row:
    name: str
    dtype: str
    seconds: float
    items: int
    padding: float | None
    agreement: float | None
    max_dlogprob: float | None
    accuracy: float
    peak_rss_gb: float
    tokens: int
    rechecked: int | None = None
    speedup: float | None = None

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds


class PeakRSS:
    """Peak resident memory of this process while the block runs. On Linux the kernel's high-water mark
    is reset on entry (/proc/self/clear_refs) and read on exit (VmHWM), so a row's peak is its own, not an
    earlier row's; elsewhere RSS is sampled every 10 ms."""

    def __enter__(self):
        self.proc, self._stop, self._thread = psutil.Process(), threading.Event(), None
        self.peak = self.proc.memory_info().rss
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()
        else:
            self.peak = max(self.peak, peak_rss_bytes("self"))
        self.peak = max(self.peak, self.proc.memory_info().rss)


def classify_process_rss(model: str, texts: list[str], threads, batch_size: int, max_batch_tokens) -> dict:
    """Peak RSS of a fresh `slimroute classify` process (fp32, defaults) over the bench tickets: the fp32
    engine's memory as a user runs it, without the bench's other rows in the same process."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "tickets.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
        command = [sys.executable, "-m", "slimroute.cli", "classify", str(src), "--labels", ",".join(LABELS),
                   "--model", model, "--out", str(out), "--dtype", "float32", "--batch-size", str(batch_size)]
        command += ["--threads", str(threads)] if threads else []
        command += ["--max-batch-tokens", str(max_batch_tokens or 0)]
        log = Path(tmp) / "stderr.log"  # a file, not a pipe: a full pipe would block the child
        start = time.perf_counter()
        with log.open("wb") as err:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
            # The child's own high-water mark, read while it runs: wait4's ru_maxrss would not do, since Linux
            # starts a forked child's maxrss at the parent's peak (this bench process's, several GB).
            peak = 0
            while proc.poll() is None:
                peak = max(peak, peak_rss_bytes(proc.pid))
                time.sleep(0.05)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {log.read_text(errors='replace')[-2000:]}")
    return {"command": "slimroute classify (fp32, defaults)", "items": len(texts),
            "peak_rss_gb": peak / 2**30, "wall_s_incl_load": seconds}


def peak_rss_bytes(pid: int | str) -> int:
    """Peak resident bytes of a running process (0 when it cannot be read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)


class GenerateBaseline:
    """What a user writes first: `generate` on the full prompt, one ticket at a time, no cache reuse."""

    def __init__(self, model, tokenizer, task: Task):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.tokens = 0

    @torch.inference_mode()
    def classify(self, texts: list[str], progress=None) -> list[Prediction]:
        preds = []
        for text in texts:
            ids = torch.tensor([encode(self.tokenizer, render_prompt(self.tokenizer, self.task, text))])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
            self.tokens += out.shape[1]
            answer = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip().lower()
            label = next((lab for lab in self.task.labels if answer.startswith(lab.lower())), None)
            preds.append(Prediction(label) if label else Prediction(error=f"unparsable answer {answer!r}"))
        return preds


def run_row(name, dtype, classifier, texts, golds, reference=None, tokens=None) -> tuple[Row, list[Prediction]]:
    classifier.classify(texts[:4])  # warm-up, excluded from the timing
    gc.collect()
    with PeakRSS() as rss:
        start = time.perf_counter()
        preds = classifier.classify(texts)
        seconds = time.perf_counter() - start
    stats = getattr(classifier, "last_stats", None)
    agreement = dlogprob = None
    if reference is not None:
        cmp = compare([str(i) for i in range(len(texts))], reference, preds)
        agreement = cmp.agreement
        dlogprob = cmp.max_abs_logprob_diff if all(p.logprobs for p in preds) else None
    accuracy = sum(p.label == g for p, g in zip(preds, golds, strict=True)) / len(golds)
    if tokens is None:
        if stats is not None:
            prefix = classifier.prefix.length if classifier.prefix else 0
            tokens = stats.padding.processed_tokens + prefix
        else:
            tokens = sum(p.num_tokens for p in preds)
    row = Row(name, dtype, seconds, len(texts), stats.padding.overhead if stats else None, agreement, dlogprob,
              accuracy, rss.peak / 2**30, int(tokens), stats.num_rechecked if stats else None)
    return row, preds


def run_bench(n=600, batch_size=32, dtypes=("float32", "bfloat16"), model="qwen2.5-coder-0.5b", threads=None,
              max_batch_tokens=512, quick=False, recheck_margin=None, log=print) -> dict:
    """recheck_margin: also run bf16 with the near-tie recheck (not needed on CPU: eager attention keeps
    bf16 batch-invariant; see kernels.pick_attention)."""
    if quick:
        n = min(n, 100)
    tickets = synthetic_tickets(600, 0)[:n]
    texts, golds = [t["text"] for t in tickets], [t["label"] for t in tickets]
    task = Task(LABELS)
    few_shot = Task(LABELS, examples=FEW_SHOT)
    max_batch_tokens = max_batch_tokens or None
    all_on = EngineConfig(batch_size=batch_size, max_batch_tokens=max_batch_tokens)
    by_count = EngineConfig(batch_size=batch_size, max_batch_tokens=None)  # the "batch 32" padding figure
    rechecked = EngineConfig(batch_size=batch_size, max_batch_tokens=max_batch_tokens, recheck_margin=recheck_margin)
    batching = f"batch {batch_size}" + (f", {max_batch_tokens}-token budget" if max_batch_tokens else "")
    attention: dict[str, str] = {}
    rows: list[Row] = []
    refs: dict[str, list[Prediction]] = {}

    def add(row: Row):
        rows.append(row)
        log(f"{row.name:40s} {row.dtype:9s} {row.items_per_s:6.2f} items/s  agree {fmt_pct(row.agreement)}  "
            f"max|Δ| {fmt_sci(row.max_dlogprob)}  pad {fmt_pct(row.padding)}  acc {fmt_pct(row.accuracy)}")

    for dtype in dtypes:
        loaded = load_model(model, dtype, threads)
        m, tok, ctx = loaded.model, loaded.tokenizer, loaded.max_positions
        attention[dtype] = loaded.attention
        if dtype == dtypes[0]:
            set_linear_kernels(m, "default")
            baseline = GenerateBaseline(m, tok, task)
            row, _ = run_row("one-at-a-time generate (plain transformers)", dtype, baseline, texts, golds)
            row.tokens = baseline.tokens
            add(row)
            set_linear_kernels(m, loaded.kernels)
        ref_row, ref = run_row("reference (1 item, full prompt, no cache)", dtype,
                               ReferenceClassifier(m, tok, task, max_positions=ctx), texts, golds)
        add(ref_row)
        if dtype == dtypes[0] and not quick:
            for name, cfg in [
                ("label scoring alone (batch 1, no cache)", EngineConfig(batch_size=1, prefix_cache=False, sort=False)),
                ("prefix cache alone (batch 1)", EngineConfig(batch_size=1, sort=False)),
                (f"batching alone (batch {batch_size}, unsorted)", EngineConfig(
                    batch_size=batch_size, max_batch_tokens=None, prefix_cache=False, sort=False, max_padding=None)),
                (f"sorted batching alone (batch {batch_size})",
                 EngineConfig(batch_size=batch_size, max_batch_tokens=None, prefix_cache=False)),
            ]:
                add(run_row(name, dtype, Engine(m, tok, task, cfg, ctx), texts, golds, ref)[0])
            set_linear_kernels(m, "default")
            add(run_row("all combined, default torch kernels", dtype, Engine(m, tok, task, all_on, ctx), texts,
                        golds, ref)[0])
            set_linear_kernels(m, loaded.kernels)
        combined = f"all combined ({batching}, {loaded.kernels} kernels, {loaded.attention} attention)"
        add(run_row(combined, dtype, Engine(m, tok, task, all_on, ctx), texts, golds, ref)[0])
        if dtype == dtypes[-1] and max_batch_tokens and not quick:
            add(run_row(f"all combined, batch {batch_size} without a token budget", dtype,
                        Engine(m, tok, task, by_count, ctx), texts, golds, ref)[0])
        refs[dtype] = ref
        if dtype == "bfloat16" and recheck_margin is not None:
            add(run_row(f"all combined + near-tie recheck (margin {recheck_margin})", dtype,
                        Engine(m, tok, task, rechecked, ctx), texts, golds, ref)[0])
        if dtype == dtypes[-1]:
            fs_ref_row, fs_ref = run_row("reference, few-shot", dtype,
                                         ReferenceClassifier(m, tok, few_shot, max_positions=ctx), texts, golds)
            add(fs_ref_row)
            engine = Engine(m, tok, few_shot, all_on, ctx)
            row, _ = run_row(f"all combined, few-shot ({len(engine.prompt.prefix_ids)}-token prefix)", dtype,
                             engine, texts, golds, fs_ref)
            add(row)
        del loaded, m
        gc.collect()
    base = rows[0].items_per_s
    for row in rows:
        row.speedup = row.items_per_s / base
    drift = None
    if "float32" in refs and "bfloat16" in refs:  # how far the bf16 reference drifts from the fp32 one
        drift = compare([str(i) for i in range(n)], refs["float32"], refs["bfloat16"]).to_dict()
        drift.pop("disagreeing_ids")
        log(f"bf16 vs fp32 reference: label agreement {fmt_pct(drift['agreement'])}, "
            f"max |Δ log-prob| {drift['max_abs_logprob_diff']:.3f}")
    fresh = None
    if "float32" in dtypes:
        fresh = classify_process_rss(model, texts, threads, batch_size, max_batch_tokens)
        log(f"fp32 engine in a fresh `slimroute classify` process: peak RSS {fresh['peak_rss_gb']:.2f} GB")
    return {"machine": machine_info(threads), "n": n, "batch_size": batch_size, "model": model,
            "attention": attention, "recheck_margin": recheck_margin, "bf16_vs_fp32": drift,
            "fp32_classify_process": fresh,
            "rows": [{**asdict(r), "items_per_s": r.items_per_s} for r in rows]}


def machine_info(threads) -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = ""
    import transformers

    import slimroute

    return {"cpu": cpu, "cores": psutil.cpu_count(logical=False), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "slimroute": slimroute.__version__, "git_sha": sha,
            "date": time.strftime("%Y-%m-%d")}


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_count(x):
    return "-" if x is None else str(x)


def fmt_sci(x):
    return "-" if x is None else f"{x:.1e}"


def markdown(record: dict, command: str) -> str:
    m = record["machine"]
    lines = [
        f"`{command}` — {record['n']} tickets, {record['model']}, {m['cpu']}, {m['threads']} threads, "
        f"torch {m['torch']}, git {m['git_sha']}, {m['date']}",
        "",
        "| row | dtype | seconds | items/s | speedup | padding | agreement | max \\|Δ log-prob\\| | accuracy "
        "| peak RSS (row) | tokens | rechecked |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    drift = record.get("bf16_vs_fp32")
    for r in record["rows"]:
        lines.append(
            f"| {r['name']} | {r['dtype']} | {r['seconds']:.1f} | {r['items_per_s']:.2f} | {r['speedup']:.2f}x | "
            f"{fmt_pct(r['padding'])} | {fmt_pct(r['agreement'])} | {fmt_sci(r['max_dlogprob'])} | "
            f"{fmt_pct(r['accuracy'])} | {r['peak_rss_gb']:.2f} GB | {r['tokens']:,} | {fmt_count(r['rechecked'])} |"
        )
    if drift:
        lines += ["", f"bf16 reference vs fp32 reference: label agreement {fmt_pct(drift['agreement'])}, "
                      f"max |Δ log-prob| {drift['max_abs_logprob_diff']:.3f}"]
    fresh = record.get("fp32_classify_process")
    if fresh:
        lines += ["", f"Peak RSS of a fresh `slimroute classify` process (fp32, defaults, the same {fresh['items']} "
                      f"tickets, model load included): {fresh['peak_rss_gb']:.2f} GB. The per-row column is "
                      "the bench process's own peak during that row (earlier rows' memory included)."]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    names = [f"{r['name']} [{r['dtype']}]" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 1.5), sharey=True)
    ax1.barh(names, [r["items_per_s"] for r in rows], color="tab:blue")
    ax1.set_xlabel("items/s")
    ax2.barh(names, [100 * (r["padding"] or 0) for r in rows], color="tab:orange")
    ax2.set_xlabel("padding overhead %")
    ax1.invert_yaxis()
    fig.suptitle(f"slimroute bench: {record['n']} tickets, {record['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(record: dict, out_dir: Path, command: str, with_plot: bool) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    paths["json"].write_text(json.dumps({**record, "command": command}, indent=2))
    paths["markdown"].write_text(markdown(record, command))
    if with_plot:
        paths["plot"] = out_dir / "bench.png"
        plot(record, paths["plot"])
    return paths
