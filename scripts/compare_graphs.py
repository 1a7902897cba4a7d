"""Time and peak workspace of one N-token text on several ONNX graphs: python scripts/compare_graphs.py N A.onnx B.onnx"""
import sys
import time

import numpy as np
import onnxruntime as ort

from bgeserve.tuning import memory

n = int(sys.argv[1]); paths = sys.argv[2:]
sess = []
for p in paths:
    o = ort.SessionOptions(); o.enable_cpu_mem_arena = False; o.intra_op_num_threads = 2
    sess.append(ort.InferenceSession(p, o))
ids = np.random.default_rng(0).integers(4, 250000, (1, n)); ids[0,0]=0; ids[0,-1]=2; mask = np.ones_like(ids)
for s in sess: s.run(None, {'input_ids': ids[:, :8], 'attention_mask': mask[:, :8]})
for rep in range(2):
    for p, s in zip(paths, sess):
        memory.trim_heap(); base = memory.rss_bytes(); memory.reset_peak_rss()
        t = time.perf_counter(); s.run(None, {'input_ids': ids, 'attention_mask': mask}); dt = time.perf_counter() - t
        print(p.split('/')[2], n, f"{dt:.2f}s {n/dt:.0f} tok/s peak {(memory.peak_rss_bytes()-base)/2**20:.0f} MiB", flush=True)
