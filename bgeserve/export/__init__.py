"""``bgeserve export``: PyTorch bge-m3 → ONNX with the heads in the graph (needs the export extra)."""

# Query rows per attention block for long texts in exported graphs. Softmax is per query row, so
# blocking is exact; it bounds the score tensor at heads × block × seq instead of heads × seq²
# (4 GiB for one 8192-token text in fp32).
ATTENTION_BLOCK = 256
