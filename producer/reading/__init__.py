"""Reading datasets: sources (JSONL, JSON, Parquet, HF), mapping, conversations, ids, tokenizing.

Imports shared/ only: nothing here knows about Redis queues or the run.
"""
