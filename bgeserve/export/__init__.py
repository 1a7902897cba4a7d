"""``bgeserve export``: PyTorch bge-m3 → ONNX with the heads in the graph (needs the export extra)."""

# Query rows per attention block for long texts in exported graphs. Softmax is per query row, so
# blocking is exact; it bounds the score tensor at heads × block × seq instead of heads × seq²
# (4 GiB for one 8192-token text in fp32).
ATTENTION_BLOCK = 256
# Beyond this many keys, rows per block shrink in proportion (graph.blocked_attention), which
# keeps a block's score tensor at a fixed size; rows never drop below ATTENTION_MIN_ROWS so the
# matmuls stay efficient (at bge-m3's 8,192-token limit the rows are 32).
ATTENTION_KEYS = 1024
ATTENTION_MIN_ROWS = 16
