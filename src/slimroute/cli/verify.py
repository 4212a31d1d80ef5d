"""`slimroute verify`: the reference and the fast path on the same rows; exit 1 on any disagreement."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer

from slimroute.accuracy.calibration import estimate_offsets
from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.cli.build import (
    calibrated,
    calibration_settings,
    check_fallback,
    engine_config,
    load,
    read_input,
    task_and_head,
)
from slimroute.engine.verify import compare
from slimroute.runtime.dtypes import exactness
from slimroute.runtime.packaged import ModelNotFoundError


def verify(
    input: Path = typer.Argument(...),
    labels: str = opt.LABELS, instructions: str = opt.INSTRUCTIONS, task: Path = opt.TASK,
    truncate_tokens: int = opt.TRUNCATE,
    model: str = opt.MODEL, dtype: str = opt.DTYPE, threads: int = opt.THREADS, device: str = opt.DEVICE,
    text_column: str = opt.TEXT_COL, id_column: str = opt.ID_COL, label_column: str = opt.LABEL_COL,
    batch_size: int = opt.BATCH, max_batch_tokens: int = opt.MAX_TOKENS, no_prefix_cache: bool = opt.NO_PREFIX,
    no_sort: bool = opt.NO_SORT, decision: str = opt.DECISION, limit: int = opt.LIMIT,
    max_padding: float = opt.MAX_PADDING, recheck_margin: float = opt.RECHECK, head: Path = opt.HEAD,
    examples: Path = opt.EXAMPLES, shots: int = opt.SHOTS, calibrate: str = opt.CALIBRATE,
    calibration_data: Path = opt.CALIBRATION_DATA, min_prob: float = opt.MIN_PROB, fallback_label: str = opt.FALLBACK,
    json_out: Path = typer.Option(None, "--json", help="Write the agreement record here."),
):
    """Run the reference and the fast path on the same items; exit 1 on any disagreement.

    With --head both apply the head, to the hidden state each computes; its log-probs are compared.
    Calibration offsets are estimated once (by the fast path; batch: over all the rows verified) and
    applied to both paths."""
    try:
        the_task, the_head, answers = task_and_head(labels, instructions, task, head, examples, shots, text_column,
                                                    label_column, truncate_tokens)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        calibration.check_data(answers, the_head)
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                               recheck_margin, min_prob, fallback_label)
        check_fallback(config, answers)
        rows = read_input(input, text_column, id_column, label_column, limit)
        router = load(model, the_task, config, dtype, threads, device, the_head)
        fast, offsets = calibrated(router.engine, calibration)
        ref = router.reference.with_calibration(offsets)
        loaded = router.loaded
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    ref_preds, ref_s = ui.run_with_progress(ref, rows, "reference")
    fast_preds, fast_s = ui.run_with_progress(fast, rows, "fast path")
    if calibration.mode == "batch" and offsets is None:
        offsets = estimate_offsets("batch", fast_preds, fast.labels, f"the {len(rows)} rows verified")
        texts = [row.text for row in rows]
        fast_preds = fast.with_calibration(offsets).redecide(texts, fast_preds)
        ref_preds = ref.with_calibration(offsets).redecide(texts, ref_preds)
    result = compare([r.id for r in rows], ref_preds, fast_preds)
    expected = exactness(loaded.precision, device=str(loaded.device))
    record = {**result.to_dict(), "expected": {"max_abs_logprob_diff": expected.max_abs_logprob_diff,
                                               "invariant": expected.invariant, "why": expected.why},
              "within_expected": expected.holds(result.max_abs_logprob_diff), "reference_s": ref_s, "fast_s": fast_s,
              "dtype": loaded.precision,
              "dtype_reason": loaded.precision_reason, "model": model, "padding_overhead": fast.stats.padding.overhead,
              "head": str(head) if head else None, "prefix_tokens": len(fast.prompt.prefix_ids),
              "truncate_tokens": the_task.truncate_tokens,
              "calibration": offsets.to_dict() if offsets is not None else None,
              "fallback": asdict(config.fallback) if config.fallback is not None else None}
    ui.console.print(
        f"dtype {loaded.precision} ({loaded.precision_reason}): "
        f"label agreement {100 * result.agreement:.2f}% ({result.num_agree}/{result.num_items}), "
        f"max |Δ log-prob| {result.max_abs_logprob_diff:.2e}; reference {ref_s:.1f}s, fast {fast_s:.1f}s "
        f"({ref_s / max(fast_s, 1e-9):.1f}x)"
    )
    ui.console.print(f"what {loaded.precision} gives here: {expected}", markup=False)
    if not record["within_expected"]:  # the labels may still agree: the claim, not the answers, is what failed
        ui.console.print(f"[yellow]warning:[/] the log-probs differ by {result.max_abs_logprob_diff:.2e}, more than "
                         f"{loaded.precision} claims on this CPU ({expected.max_abs_logprob_diff:g}); please report it "
                         "with the output of `slimroute info --json`")
    if result.disagreeing_ids:
        ui.console.print(f"[red]disagreeing ids:[/] {', '.join(result.disagreeing_ids[:50])}")
    if json_out:
        json_out.write_text(json.dumps(record, indent=2))
    raise typer.Exit(0 if result.ok else 1)
