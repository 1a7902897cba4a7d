"""``bgeserve export``: PyTorch bge-m3 → ONNX with the heads in the graph (needs the export extra)."""

# Query rows per attention block for padded chunks in exported graphs (an unpadded chunk uses
# the fused MultiHeadAttention). Softmax is per query row, so blocking is exact; it bounds the
# score tensor at heads × block × seq instead of heads × seq² (4 GiB for 8192 tokens in fp32).
ATTENTION_BLOCK = 256

# Token rows per FFN block. 2,048 rows make each [rows, 4096] fp32 buffer 32 MiB, which glibc
# always maps with mmap and unmaps on free; smaller blocks land in the malloc heap, which does
# not shrink (measured at 8,192 tokens: 1,024 rows +380 MiB peak anonymous memory for int8,
# 2,048 rows +300, unblocked +521). The GEMMs run as fast at 2,048 rows as at 8,192.
FFN_ROWS = 2048
