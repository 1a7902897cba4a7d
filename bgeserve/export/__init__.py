"""``bgeserve export``: PyTorch bge-m3 → ONNX with the heads in the graph (needs the export extra)."""

# Query rows per attention block for padded chunks in exported graphs (an unpadded chunk uses
# the fused MultiHeadAttention). Softmax is per query row, so blocking is exact; it bounds the
# score tensor at heads × block × seq instead of heads × seq² (4 GiB for 8192 tokens in fp32).
ATTENTION_BLOCK = 256

# Token rows per FFN block. Chosen when glibc's heap served the workspace: [2048, 4096] fp32
# buffers (32 MiB) were always mmapped and given back, 16 MiB ones fragmented the heap
# (8,192 tokens, int8: 1,024 rows +380 MiB peak anonymous memory, 2,048 rows +300, unblocked
# +521). CPU sessions now draw from a shrinking ONNX Runtime arena instead (runtime/onnx.py);
# the GEMMs run as fast at 2,048 rows as at 8,192.
FFN_ROWS = 2048

# A step's exit status (export/steps.py) where the checkpoint was refused and the step said why
# in one line: the export says no more (no traceback on top).
REFUSED = 3
