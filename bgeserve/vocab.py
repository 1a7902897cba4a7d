"""bge-m3's (XLM-R's) special token ids and vocabulary size: a leaf, importable from anywhere.

The ids are fixed by the XLM-R vocabulary every bge-m3 tokenizer shares; the size is the real
model's (a random test model may be smaller: the loaded tokenizer's own ``vocab_size`` is the
bound its inputs are checked against).
"""

from __future__ import annotations

CLS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_IDS = (CLS_ID, PAD_ID, EOS_ID, UNK_ID)
SPECIAL_TOKENS = {"<s>": CLS_ID, "<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
VOCAB_SIZE = 250_002  # BAAI/bge-m3
