"""``bgeserve export``: PyTorch bge-m3 → ONNX with the heads in the graph (needs the export extra)."""

# Query rows per attention block for padded chunks in exported graphs (an unpadded chunk uses
# the fused MultiHeadAttention). Softmax is per query row, so blocking is exact; it bounds the
# score tensor at heads × block × seq instead of heads × seq² (4 GiB for 8192 tokens in fp32).
ATTENTION_BLOCK = 256
