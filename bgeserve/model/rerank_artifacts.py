"""Which reranker files to open: a local export or snapshot, or the pinned hub model.

bge-reranker-v2-m3 is published as a PyTorch checkpoint (``model.safetensors``); bgeserve serves
it from its own export (``bgeserve export --model BAAI/bge-reranker-v2-m3``), made from the hub
snapshot at the commit pinned here.
"""

from __future__ import annotations

# The hub's main at 2026-05: its revision as two independent deployments record it (not
# verifiable from this offline machine; `huggingface-cli download` prints the commit it got).
RERANK_REPO, RERANK_REVISION = "BAAI/bge-reranker-v2-m3", "953dc6f6f85a1b2dbfca4c34a2796e7dde08d41e"
RERANK_MODEL_ID = "bge-reranker-v2-m3"
