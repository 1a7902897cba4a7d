"""Tokens/s of raw session.run for batches of b texts of L tokens: python scripts/chunk_shapes.py MODEL.onnx"""
import sys
import time

import numpy as np
import onnxruntime as ort

path = sys.argv[1]
o = ort.SessionOptions(); o.enable_cpu_mem_arena = False; o.intra_op_num_threads = 2
s = ort.InferenceSession(path, o)
rng = np.random.default_rng(0)
def run(b, L):
    ids = rng.integers(4, 250000, (b, L)); ids[:,0]=0; ids[:,-1]=2
    s.run(['dense','sparse_weights'], {'input_ids': ids, 'attention_mask': np.ones_like(ids)})
run(1, 8)
for L, bs in ((16, (1, 8, 32)), (64, (1, 4, 16)), (256, (1, 2, 4)), (512, (1, 2))):
    total = 2048
    line = []
    for b in bs:
        n = total // (b * L)
        t = time.perf_counter()
        for _ in range(n): run(b, L)
        dt = time.perf_counter() - t
        line.append(f"b{b}: {n*b*L/dt:.0f}")
    print(path.split('/')[2], path.split('/')[3], f"L={L}", " ".join(line), flush=True)
