"""Training examples: built-in prompt sets and dataset files (GSM8K, verl, simple JSONL/Parquet)."""
