"""Bulk embedding of datasets: ``bgeserve bulk INPUT... --output DIR``.

Files (JSONL, Parquet, CSV) → the server's ``Engine`` → Parquet shards, resumable, bad rows
reported by id. ``local`` runs the job in this process; ``bgeserve.ray`` runs the same job as
a Ray Data pipeline. Needs ``pip install 'bgeserve[bulk]'`` (pyarrow, tqdm).
"""
