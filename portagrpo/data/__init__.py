"""Data: records.py (the training schema, JSONL/Parquet loading, the prompt loader), tasks.py
(built-in generated tasks), prepare.py (`portagrpo data`: public files -> the schema)."""
from portagrpo.data.records import DataError, PromptLoader, PromptRecord, load_records

__all__ = ["DataError", "PromptLoader", "PromptRecord", "load_records"]
