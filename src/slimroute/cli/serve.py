"""`slimroute serve`: the HTTP service (docs/server.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.cli.build import calibration_settings, check_fallback, engine_config, resolve_dtype, task_and_head


def serve(
    task: Path = typer.Option(None, "--task", help="Task file: one task or several (docs/server.md)."),
    labels: str = opt.LABELS, instructions: str = opt.INSTRUCTIONS, truncate_tokens: int = opt.TRUNCATE,
    model: str = opt.MODEL, dtype: str = opt.DTYPE, threads: int = opt.THREADS, device: str = opt.DEVICE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port"),
    batch_size: int = opt.BATCH, max_batch_tokens: int = opt.MAX_TOKENS, max_padding: float = opt.MAX_PADDING,
    recheck_margin: float = opt.RECHECK, head: Path = opt.HEAD, min_prob: float = opt.MIN_PROB,
    fallback_label: str = opt.FALLBACK,
    max_gather_tokens: int = typer.Option(
        2048, "--max-gather-tokens", help="Item tokens in one engine call; a larger request runs over several, other "
        "requests taking turns between them (0: no cap)."
    ),
    preempt_tokens: int = typer.Option(
        1024, "--preempt-tokens", help="While an engine call has more item tokens than this left to run, requests "
        "that arrive run between its steps (0: calls run one at a time)."
    ),
    chunk_tokens: int = typer.Option(
        256, "--chunk-tokens", help="A text longer than this runs alone in passes of this many tokens, other requests "
        "running in between (a multiple of 32; 0: every text in one pass)."
    ),
    decision: str = opt.DECISION,
    max_wait_ms: float = typer.Option(50.0, "--max-wait-ms", help="How long a batch waits for more requests."),
    max_queue: int = typer.Option(1024, "--max-queue", help="Texts waiting; beyond this: 503 + Retry-After."),
    max_texts: int = typer.Option(256, "--max-texts", help="Texts per request."),
    max_text_chars: int = typer.Option(20_000, "--max-text-chars", help="Characters per text."),
    max_text_tokens: int = typer.Option(2048, "--max-text-tokens", help="Tokens per text (0: the context)."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Request body size."),
    read_timeout: float = typer.Option(30.0, "--read-timeout", help="Seconds a request's headers, and then its body, "
                                       "may take to arrive (else 408 and the connection closes)."),
    access_log: bool = typer.Option(False, "--access-log", help="Log every request."),
    api_key: list[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* "
                                      "(repeat for several keys; default: $SLIMROUTE_API_KEY, comma-separated)."),
    api_key_file: Path = typer.Option(None, "--api-key-file", help="Accepted keys, one per line ('#' comments)."),
    metrics_need_key: bool = typer.Option(False, "--metrics-need-key", help="Put /metrics behind the key too."),
    examples: Path = opt.EXAMPLES, shots: int = opt.SHOTS, calibrate: str = opt.CALIBRATE,
    calibration_data: Path = opt.CALIBRATION_DATA, text_column: str = opt.TEXT_COL, label_column: str = opt.LABEL_COL,
):
    """Serve classification over HTTP, micro-batching concurrent requests (docs/server.md).

    Calibration offsets are estimated or fitted once at startup (batch: from --calibration-data, never
    from requests) and fixed while the server runs."""
    from slimroute.server import TaskSet, prepare  # lazy: fastapi and uvicorn load only to serve
    from slimroute.server import serve as run_server  # lazy: as above
    from slimroute.server.tasks import with_accuracy_options  # lazy: as above

    try:
        the_head, head_tasks = None, None
        if head:  # one task: the head's, or the one given (which must be the prompt it was tuned with)
            single, the_head, _ = task_and_head(labels, instructions, task, head)
            head_tasks = TaskSet({single.name: single}, single.name)
        task_set, settings = prepare(
            task_file=task, labels=labels, instructions=instructions, batch_size=batch_size, tasks=head_tasks,
            max_gather_tokens=max_gather_tokens, preempt_tokens=preempt_tokens, max_wait_ms=max_wait_ms,
            max_queue=max_queue, max_texts=max_texts,
            max_text_chars=max_text_chars, max_text_tokens=max_text_tokens, max_body_bytes=max_body_bytes,
            read_timeout_s=read_timeout, api_keys=api_key, api_key_file=api_key_file, metrics_need_key=metrics_need_key)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        task_set = with_accuracy_options(task_set, examples, shots, text_column, label_column or "label", calibration,
                                         the_head, truncate_tokens)
        config = engine_config(batch_size, max_batch_tokens, False, False, decision, max_padding, recheck_margin,
                               min_prob, fallback_label, chunk_tokens)
        for served in task_set.tasks.values():
            check_fallback(config, the_head.labels if the_head else served.labels)
        choice = resolve_dtype(dtype, device)
    except ValueError as exc:
        ui.fail(str(exc))
    ui.console.print(f"serving {', '.join(task_set.tasks)} on http://{host}:{port} (docs: /docs), loading {model} "
                  f"({choice})")
    raise typer.Exit(run_server(task_set, model, choice, threads, device, config, settings, host, port,
                                access_log=access_log, head=the_head, calibration=calibration))
