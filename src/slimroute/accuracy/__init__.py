"""Making and measuring right answers: calibration offsets, tuned heads (and tuning them), few-shot examples from a
file, evaluation against gold labels and its metrics."""
