"""scripts/bench.py's parts, one module per concern.

``common`` (constants, logging, vectors, machine), ``corpus`` (the fixed texts), one module per
measured mode run in a child process (``flag``, ``raw``, ``engine`` (and ``rss``), ``http`` (and
``load``)), ``runner`` (children: spawn, dispatch), ``report`` (tables, ratios, agreement) and
``roofline`` (GFLOP per corpus from the model's dims, the machine's GEMM ceilings).
"""
