"""Rows in (CSV / JSONL / Parquet / text, standard input), durable records out, and the synthetic sample tickets."""
