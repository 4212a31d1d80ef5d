"""The GEMM-only limit of a run, and where the rest of its time goes.

`GemmCalls` records every GEMM the decoder's linear layers run while an engine classifies (which layer, how many
rows); `replay` runs those same GEMMs again, in the same order, on inputs of the same shapes and kinds, and times
them alone. items / that time is the speed the run would have if everything around the GEMMs (norms, rotary
embeddings, attention, quantising rows, copies, the label scorer, Python) took no time: the row's *share of the
limit* is the GEMM time over the row's time. `Limit.paired` times the row and the replay in turns, a few times, and
takes the median of each and of their ratios, so a busy moment of a noisy machine falls on both sides or on neither.
The output head / label scorer is not a decoder layer and stays out. `large_gemm_rate` measures how fast this CPU runs
one large GEMM of the same kind (the model's widest layer, the best of a few row counts: at the most rows its fp32
output outgrows the caches), so the decoder GEMMs' own rate has a yardstick.

`profile_ops` runs a classifier under torch's profiler and gives the top ops by self time, with the decoder GEMMs'
share from the same run (they are marked with a profiler range, DECODER_GEMM)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from slimroute.runtime.int8 import ACTIVATIONS, Int8Linear
from slimroute.runtime.linear import OneDNNLinear

DECODER_GEMM = "slimroute::decoder_gemm"  # the profiler range around each decoder GEMM


@dataclass(frozen=True)
class GemmCall:
    gemm: Callable[[torch.Tensor], torch.Tensor]  # the layer's own GEMM, unwrapped
    rows: int
    in_features: int
    dtype: torch.dtype
    kernel: str  # "onednn" / "fbgemm" (int8, the integers as that kernel takes them) or "float"
    out_features: int = 0

    @property
    def macs(self) -> int:
        return self.rows * self.in_features * self.out_features


class GemmCalls:
    """`with GemmCalls(model) as calls:` records each GEMM of the model's linear layers but the output head
    (Int8Linear's integer product; a float layer's whole forward, bias fused in oneDNN's op) into calls.calls.
    Each GEMM also runs inside a DECODER_GEMM profiler range. The layers are as they were after the block."""

    def __init__(self, model: nn.Module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.layers = [m for m in model.modules() if m is not head
                       and (isinstance(m, (Int8Linear, OneDNNLinear)) or type(m) is nn.Linear)]
        self.calls: list[GemmCall] = []

    def __enter__(self) -> GemmCalls:
        for layer in self.layers:
            if isinstance(layer, Int8Linear):
                layer.integer_product = self._recording(layer.integer_product, layer.in_features, layer.kernel,
                                                        layer.out_features)
            else:
                layer.forward = self._recording(layer.forward, layer.in_features, "float", layer.out_features)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:  # the instance attributes go: the class's methods are back
            layer.__dict__.pop("integer_product", None)
            layer.__dict__.pop("forward", None)

    def _recording(self, gemm, in_features: int, kernel: str, out_features: int):
        def recorded(x: torch.Tensor) -> torch.Tensor:
            self.calls.append(GemmCall(gemm, x.numel() // in_features, in_features, x.dtype, kernel, out_features))
            with torch.profiler.record_function(DECODER_GEMM):
                return gemm(x)
        return recorded


def replay(calls: list[GemmCall], passes: int = 3) -> float:
    """Seconds the recorded GEMMs take alone, run again in their order: the best of `passes` passes (a busy machine
    slows some passes; the inputs are made first, as rows of one buffer per input width and kind, and their making
    is not timed). Integer GEMMs and float GEMMs take the same time whatever the numbers in them."""
    buffers: dict[tuple, torch.Tensor] = {}
    for call in calls:
        key = (call.in_features, call.dtype, call.kernel)
        rows = max(call.rows, buffers[key].shape[0] if key in buffers else 0)
        buffers[key] = _inputs(rows, call.in_features, call.dtype, call.kernel)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(passes):
            start = time.perf_counter()
            for call in calls:
                call.gemm(buffers[(call.in_features, call.dtype, call.kernel)][:call.rows])
            best = min(best, time.perf_counter() - start)
    return best


LARGE_ROWS = (256, 512, 1024, 2048)  # large_gemm_rate's row counts: past what blocking or threading leaves idle;
# at 2048 rows the widest layer's fp32 output (80 MB for 9728 columns) no longer fits a CPU's caches


def large_gemm_rate(calls: list[GemmCall], passes: int = 3) -> float:
    """Multiply-adds per second of one large GEMM of the recorded kind: the widest recorded layer (in x out) on each
    of LARGE_ROWS rows, the best of `passes` calls each, the fastest of them: the yardstick for the decoder GEMMs'
    own rate."""
    widest = max(calls, key=lambda call: call.in_features * call.out_features)
    rate = 0.0
    with torch.inference_mode():
        for rows in LARGE_ROWS:
            x = _inputs(rows, widest.in_features, widest.dtype, widest.kernel)
            widest.gemm(x)
            best = float("inf")
            for _ in range(passes):
                start = time.perf_counter()
                widest.gemm(x)
                best = min(best, time.perf_counter() - start)
            rate = max(rate, rows * widest.in_features * widest.out_features / best)
    return rate


def _inputs(rows: int, width: int, dtype: torch.dtype, kernel: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if kernel == "float":
        return torch.randn(rows, width, generator=generator).to(dtype)
    act_max, shift = ACTIVATIONS[kernel]  # integers as the kernel takes them (int8.RowQuantizer)
    ints = torch.randint(-act_max, act_max + 1, (rows, width), generator=generator)
    return (ints + shift).to(dtype)


@dataclass(frozen=True)
class Limit:
    """A row's GEMM-only limit: its items, its own seconds, and the seconds its decoder GEMMs take alone; their
    multiply-adds and, for a yardstick, one large GEMM's rate here (large_gemm_rate; 0: not measured)."""

    items: int
    row_seconds: float
    gemm_seconds: float
    num_gemms: int
    macs: int = 0
    large_rate: float = 0.0
    paired_share: float | None = None  # Limit.paired: the median of the passes' own GEMM / row time ratios
    passes: int = 1

    @classmethod
    def of(cls, items: int, row_seconds: float, calls: list[GemmCall]) -> Limit:
        """The limit of a row that ran these GEMMs: replayed, and one large GEMM of their kind timed."""
        return cls(items, row_seconds, replay(calls), len(calls), sum(call.macs for call in calls),
                   large_gemm_rate(calls))

    @classmethod
    def paired(cls, items: int, run: Callable[[], object], calls: list[GemmCall], passes: int = 3) -> Limit:
        """The limit of a row that ran these GEMMs, measured in turns: `passes` times the row again (run()) and
        then its GEMMs alone (one replay); the medians of the row's seconds, the GEMMs' seconds and their ratios."""
        rows, gemms = [], []
        for _ in range(passes):
            start = time.perf_counter()
            run()
            rows.append(time.perf_counter() - start)
            gemms.append(replay(calls, passes=1))
        return cls(items, statistics.median(rows), statistics.median(gemms), len(calls),
                   sum(call.macs for call in calls), large_gemm_rate(calls),
                   statistics.median(g / r for g, r in zip(gemms, rows, strict=True)), passes)

    @property
    def rate(self) -> float:
        """The decoder GEMMs' multiply-adds per second, replayed."""
        return self.macs / self.gemm_seconds

    @property
    def efficiency(self) -> float:
        """Their rate as a share of one large GEMM's here."""
        return self.rate / self.large_rate if self.large_rate else 0.0

    @property
    def items_per_s(self) -> float:
        """What the row would do if only its GEMMs took time."""
        return self.items / self.gemm_seconds

    @property
    def share(self) -> float:
        """The row's items/s as a share of the limit's (= GEMM seconds / row seconds; paired: the median of the
        passes' own ratios)."""
        return self.paired_share if self.paired_share is not None else self.gemm_seconds / self.row_seconds

    def to_dict(self) -> dict:
        return {"items_per_s": self.items_per_s, "share": self.share, "gemm_seconds": self.gemm_seconds,
                "num_gemms": self.num_gemms, "macs": self.macs, "gemm_mac_per_s": self.rate,
                "large_gemm_mac_per_s": self.large_rate, "gemm_efficiency": self.efficiency,
                "row_seconds": self.row_seconds, "passes": self.passes}


def profile_ops(classifier, texts: list[str], top: int = 15) -> dict:
    """Run classifier.classify(texts) under torch's profiler: the top ops by self CPU time ({name, self_s, share,
    calls}), the run's seconds, and the decoder GEMMs' share of it (their profiler range's total, GemmCalls)."""
    from torch.profiler import ProfilerActivity, profile  # lazy: the profiler only for --profile

    with GemmCalls(classifier.model), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        classifier.classify(texts)
        seconds = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6 or seconds
    ranges = [e for e in events if e.key == DECODER_GEMM]
    gemm = sum(e.cpu_time_total for e in ranges) / 1e6
    ops = sorted((e for e in events if e.key != DECODER_GEMM), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"seconds": seconds, "profiled_s": total, "decoder_gemm_s": gemm, "decoder_gemm_share": gemm / total,
            "ops": [{"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / 1e6 / total,
                     "calls": e.count} for e in ops[:top]]}


def profile_markdown(dtype: str, profile: dict) -> list[str]:
    """profile_ops's result as a markdown table."""
    lines = [f"Where the time goes, {dtype} (`--profile`: torch profiler over one classify of the same tickets, "
             f"{profile['profiled_s']:.1f} s of op time): decoder GEMMs "
             f"{100 * profile['decoder_gemm_share']:.1f}%", "",
             "| op | self s | share | calls |", "|---|---:|---:|---:|"]
    lines += [f"| {op['name'][:60]} | {op['self_s']:.2f} | {100 * op['share']:.1f}% | {op['calls']:,} |"
              for op in profile["ops"]]
    return lines
