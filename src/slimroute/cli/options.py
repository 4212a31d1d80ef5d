"""The flags several commands share, each mapped to one config field."""

import typer

from slimroute.runtime.packaged import DEFAULT_MODEL

MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Packaged name, HF repo id, model folder or .gguf file.")
DTYPE = typer.Option("auto", "--dtype", help="auto (from the CPU: int8 on x86 with AVX2, bfloat16 with native BF16 "
                                             "but no VNNI, else float32), float32, bfloat16 or int8.")
THREADS = typer.Option(None, "--threads", help="Torch threads (default: physical cores).")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
LABELS = typer.Option(None, "--labels", "-l", help="Comma-separated labels, e.g. billing,technical,account.")
INSTRUCTIONS = typer.Option(None, "--instructions", help="Instructions for the model (system prompt).")
TASK = typer.Option(None, "--task", help="Task file (YAML/JSON: labels (names or {name, description}), "
                                         "instructions, examples).")
TRUNCATE = typer.Option(None, "--truncate-tokens", help="Read only each text's first N tokens: faster on long texts "
                                                     "(a cut text is marked truncated; check accuracy with eval). "
                                                     "Default: the task file's truncate_tokens, else whole texts; "
                                                     "0: whole texts.")
TEXT_COL = typer.Option("text", "--text-column", help="Text column (of the input, --examples, --calibration-data); "
                                                      "several, comma-separated (subject,body), make one text.")
ID_COL = typer.Option("id", "--id-column")
LABEL_COL = typer.Option(None, "--label-column", help="Gold-label column (default: 'label' when present; also "
                                                      "the label column of --examples and --calibration-data).")
EXAMPLES = typer.Option(None, "--examples", help="Labelled file (CSV/JSONL/Parquet) of few-shot examples for the "
                                                 "cached prefix: --shots per label, the first of each in file order.")
SHOTS = typer.Option(None, "--shots", help="Examples per label from --examples (default 2).")
CALIBRATE = typer.Option("none", "--calibrate", help="none, content-free, batch or fitted: offsets subtracted from "
                                                     "the label log-probs before the decision (README; not with "
                                                     "--head).")
CALIBRATION_DATA = typer.Option(None, "--calibration-data", help="fitted: labelled rows to fit the offsets on; "
                                                                 "batch: texts to estimate them from.")
BATCH = typer.Option(32, "--batch-size", "-b")
MAX_TOKENS = typer.Option(512, "--max-batch-tokens",
                          help="Padded item tokens per batch (items x longest); 0: batch by count only.")
NO_PREFIX = typer.Option(False, "--no-prefix-cache", help="Run the whole prompt for every item.")
NO_SORT = typer.Option(False, "--no-sort", help="Batch in input order instead of by length.")
DECISION = typer.Option("greedy", "--decision", help="greedy or max-prob (see README).")
LIMIT = typer.Option(None, "--limit", help="Only the first N rows.")
MAX_PADDING = typer.Option(0.0, "--max-padding", help="Cap on a batch's padded share of tokens (0: none; "
                                                        "batches are the cheapest split by default).")
HEAD = typer.Option(None, "--head", help="A head folder from `slimroute tune`: its softmax over its labels decides; "
                                          "the task (prompt) is the head's unless --labels/--task is given.")
MIN_PROB = typer.Option(None, "--min-prob", help="A floor under the answers: when the chosen label's probability "
                                                  "(p_<label>) is below this, answer --fallback-label instead "
                                                  "(the model's choice stays in model_label). Off by default.")
FALLBACK = typer.Option(None, "--fallback-label", help="The answer below --min-prob (default: unsure); not a task "
                                                      "label.")
RECHECK = typer.Option(None, "--recheck-margin",
                       help="Re-decide near-ties (log-prob gap below this) on the exact one-at-a-time path. "
                            "Off by default: not needed on CPU, where bf16 is batch-invariant.")
