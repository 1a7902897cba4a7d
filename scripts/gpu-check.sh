#!/usr/bin/env bash
# bgeserve GPU check: one NVIDIA GPU, a few minutes, packages preinstalled, nothing downloaded.
#
#   scripts/gpu-check.sh [WORK_DIR]
#
# 1. environment: GPUs, onnxruntime's providers;
# 2. a random-weight bge-m3 (full size by default: bge-m3's exact compute), exported fp32 + fp16;
# 3. CUDA parity against the CPU fp32 engine (dense cosine >= 0.999; sparse and ColBERT shown);
# 4. TensorRT: warmup-only for two small shapes (cold: builds the engine), then again (warm:
#    "trt cache: found N cached engines"), and TensorRT parity;
# 5. a throughput table: tokens/s at several batch x length shapes, CUDA and TensorRT, with
#    each shape's first (cold) run;
# 6. one embed() of a mixed corpus with chunk lengths rounded to 32 (the GPU default,
#    BGE_M3_PAD_MULTIPLE) and not: what fewer distinct shapes buy.
# Each step prints PASS, FAIL or SKIP (a provider missing is a SKIP, not a failure); the exit
# status is 1 when any step failed. Figures also land in WORK_DIR/gpu-check.md.
#
# Knobs (environment): PYTHON (default .venv/bin/python, else python3), GPU_CHECK_SIZE=full|tiny
# (tiny: checks the script in seconds, figures meaningless), GPU_CHECK_MAX_SEQ (TensorRT profile
# and parity lengths, default 2048), GPU_CHECK_MAX_CHUNK (profile batch, default 32),
# GPU_CHECK_WARMUP_SHAPES (default 1x128,4x512), GPU_CHECK_SHAPES (throughput, default
# 1x128,8x128,32x128,1x512,8x512,32x512,4x2048), GPU_CHECK_ITERS (default 10),
# GPU_CHECK_ROUND_TEXTS (the rounding step's corpus, default 512), GPU_CHECK_EXPORT_ARGS (extra `bgeserve export` arguments, e.g. "--attention-block 0"),
# GPU_CHECK_CPU=1 (a CPU fp32 row in the throughput table, for scale).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
[ -z "$PY" ] && { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
WORK="${1:-${GPU_CHECK_DIR:-$(mktemp -d /tmp/bgeserve-gpu-check.XXXXXX)}}"
SIZE="${GPU_CHECK_SIZE:-full}"
MAX_SEQ="${GPU_CHECK_MAX_SEQ:-2048}"
MAX_CHUNK="${GPU_CHECK_MAX_CHUNK:-32}"
WARMUP_SHAPES="${GPU_CHECK_WARMUP_SHAPES:-1x128,4x512}"
SHAPES="${GPU_CHECK_SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,4x2048}"
ITERS="${GPU_CHECK_ITERS:-10}"
ROUND_TEXTS="${GPU_CHECK_ROUND_TEXTS:-512}"
MODEL="$WORK/model-$SIZE"
EXPORT="$WORK/export-$SIZE"
CACHE="$WORK/cache"
REPORT="$WORK/gpu-check.md"
mkdir -p "$WORK" "$CACHE"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 BGE_M3_LOG_FORMAT=text \
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" TOKENIZERS_PARALLELISM=false
unset BGE_M3_MODEL BGE_M3_MODEL_PATH BGE_M3_EP BGE_M3_WARMUP_ONLY BGE_M3_TRT_WARMUP_SHAPES

FAILED=0
declare -a SUMMARY=()
say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
pass() { SUMMARY+=("PASS  $1"); say "PASS  $1"; }
fail() { SUMMARY+=("FAIL  $1"); say "FAIL  $1"; FAILED=1; }
skip() { SUMMARY+=("SKIP  $1"); say "SKIP  $1"; }
step() { printf '\n=== %s ===\n' "$*" | tee -a "$REPORT"; }
elapsed() { echo $(( $(date +%s) - $1 )); }

# The Python half: `helper COMMAND ARGS...` (parity, throughput, providers).
helper() {
  "$PY" - "$@" <<'PYEOF'
import sys, time
import numpy as np

from bgeserve.model.artifacts import resolve
from bgeserve.config import Settings
from bgeserve.engine import Engine
from bgeserve.runtime import gpu
from bgeserve.runtime.onnx import available_providers
from bgeserve.service.plan import engine_config, resolve_gpu

def settings(ep, variant, export, cache, max_seq, max_chunk):
    env = {"BGE_M3_EP": ep, "BGE_M3_MODEL": variant, "BGE_M3_MODEL_PATH": export,
           "BGE_M3_CACHE_DIR": cache, "BGE_M3_MAX_SEQ_LENGTH": max_seq,
           "BGE_M3_MAX_CHUNK": max_chunk, "HF_HUB_OFFLINE": "1"}
    return resolve_gpu(Settings.from_env(env))

def engine(s):
    art = resolve(model_path=s.model_path, variant=s.variant, cache_dir=s.cache_dir, offline=True)
    return Engine(artifacts=art, config=engine_config(s))

def inputs(max_seq, vocab):
    rng = np.random.default_rng(0)
    lengths = [n for n in (4, 17, 64, 200, 511, 1000, 2000) if n <= int(max_seq)] + [int(max_seq)]
    return [[0, *rng.integers(4, vocab, n - 2).tolist(), 2] for n in lengths]

def cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "providers":
    have = available_providers()
    if "tensorrt" in have:
        # onnxruntime-gpu lists TensorRT whenever its provider library is present; the TensorRT
        # runtime itself (libnvinfer) is a separate install. Without it, it is a SKIP.
        import ctypes
        for lib in ("libnvinfer.so.10", "libnvinfer.so"):
            try:
                ctypes.CDLL(lib)
                break
            except OSError:
                pass
        else:
            have.remove("tensorrt")
            print("TensorRT: onnxruntime has the provider but libnvinfer does not load "
                  "(TensorRT 10 not installed or not on LD_LIBRARY_PATH)", file=sys.stderr)
    print(" ".join(have), gpu.detect_gpu_count())
elif cmd == "parity":  # EP VARIANT EXPORT CACHE MAX_SEQ MAX_CHUNK
    ep, variant, export, cache, max_seq, max_chunk = args
    with engine(settings("cpu", "fp32", export, cache, max_seq, max_chunk)) as ref:
        texts = inputs(max_seq, ref.tokenizer.vocab_size)
        want = ref.embed(texts, dense=True, sparse=True, colbert=True)
    with engine(settings(ep, variant, export, cache, max_seq, max_chunk)) as eng:
        got = eng.embed(texts, dense=True, sparse=True, colbert=True)
    dense = min(cos(a, b) for a, b in zip(want.dense, got.dense))
    sparse_ids = np.mean([len(set(a[0].tolist()) & set(b[0].tolist())) / max(len(a[0]), 1)
                          for a, b in zip(want.sparse, got.sparse)])
    colbert = min(min(cos(x, y) for x, y in zip(a, b)) for a, b in zip(want.colbert, got.colbert))
    print(f"{ep}/{variant} vs cpu/fp32 over {len(texts)} texts of up to {max_seq} tokens: "
          f"dense cos min {dense:.6f}, sparse id overlap {sparse_ids:.4f}, "
          f"colbert cos min {colbert:.5f}")
    sys.exit(0 if dense >= 0.999 else 1)
elif cmd == "throughput":  # EP VARIANT EXPORT CACHE MAX_SEQ MAX_CHUNK SHAPES ITERS
    ep, variant, export, cache, max_seq, max_chunk, shapes, iters = args
    s = settings(ep, variant, export, cache, max_seq, max_chunk)
    eng = engine(s)
    fwd = eng.open_forward(0)
    for shape in shapes.split(","):
        b, n = (int(x) for x in shape.lower().split("x"))
        if n > int(max_seq) or b > int(max_chunk):
            print(f"| {ep} | {variant} | {b}x{n} | outside the profile | | |")
            continue
        ids = np.random.default_rng(1).integers(4, eng.tokenizer.vocab_size, (b, n))
        ids[:, 0], ids[:, -1] = 0, 2
        mask = np.ones_like(ids)
        started = time.perf_counter()
        fwd.run(ids, mask, dense=True, sparse=True, colbert=False)  # first run of the shape
        cold = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(int(iters)):
            fwd.run(ids, mask, dense=True, sparse=True, colbert=False)
        per = (time.perf_counter() - started) / int(iters)
        print(f"| {ep} | {variant} | {b}x{n} | {cold * 1000:.1f} | {per * 1000:.1f} | "
              f"{b * n / per:,.0f} |")
    fwd.close()
    eng.close()
elif cmd == "rounding":  # EP VARIANT EXPORT CACHE MAX_SEQ MAX_CHUNK TEXTS
    # One embed() of TEXTS random texts of 16..512 tokens, chunk lengths rounded up to a
    # multiple of 1 (none) or 32 (the GPU default): every new shape costs a GPU a first run.
    ep, variant, export, cache, max_seq, max_chunk, n = args
    import dataclasses
    for multiple in (1, 32):
        s = dataclasses.replace(settings(ep, variant, export, cache, max_seq, max_chunk),
                                pad_multiple=multiple)
        with engine(s) as eng:
            rng = np.random.default_rng(2)
            texts = [[0, *rng.integers(4, eng.tokenizer.vocab_size, k - 2).tolist(), 2]
                     for k in rng.integers(16, 513, int(n))]
            eng.embed([[0, 5, 2]], dense=True, sparse=True)  # the session is open and warm
            started = time.perf_counter()
            eng.embed(texts, dense=True, sparse=True)
            wall = time.perf_counter() - started
        tokens = sum(len(t) for t in texts)
        print(f"| {ep} | {variant} | {multiple} | {int(n)} | {wall:.2f} | {tokens / wall:,.0f} |")
PYEOF
}

: > "$REPORT"
step "environment"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv,noheader \
    2>&1 | tee -a "$REPORT"
else
  say "nvidia-smi not found"
fi
read -r -a PROVIDERS_AND_COUNT <<<"$(helper providers 2> >(tee -a "$REPORT" >&2))"
GPUS="${PROVIDERS_AND_COUNT[-1]}"
PROVIDERS=" ${PROVIDERS_AND_COUNT[*]:0:${#PROVIDERS_AND_COUNT[@]}-1} "
say "onnxruntime providers:${PROVIDERS}| GPUs under /proc/driver/nvidia/gpus: $GPUS"
HAVE_CUDA=0; HAVE_TRT=0
[[ "$PROVIDERS" == *" cuda "* && "$GPUS" -gt 0 ]] && HAVE_CUDA=1
[[ "$PROVIDERS" == *" tensorrt "* && "$GPUS" -gt 0 ]] && HAVE_TRT=1

step "model ($SIZE) and export (fp32 + fp16)"
t0=$(date +%s)
if [ -f "$MODEL/config.json" ] || "$PY" -m bgeserve build-random-model --size "$SIZE" --out "$MODEL"; then
  pass "random $SIZE model at $MODEL ($(elapsed "$t0")s)"
else
  fail "build-random-model --size $SIZE"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi
t0=$(date +%s)
# shellcheck disable=SC2086  # GPU_CHECK_EXPORT_ARGS is a list of words
if [ -f "$EXPORT/manifest.json" ] || "$PY" -m bgeserve export --model "$MODEL" --out "$EXPORT" \
    --variant fp32 --variant fp16 ${GPU_CHECK_EXPORT_ARGS:-}; then
  pass "export fp32 + fp16 at $EXPORT ($(elapsed "$t0")s)"
else
  fail "bgeserve export"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi

step "CUDA parity against CPU fp32"
if [ "$HAVE_CUDA" = 1 ]; then
  for variant in fp32 fp16; do
    if out="$(helper parity cuda "$variant" "$EXPORT" "$CACHE" "$MAX_SEQ" "$MAX_CHUNK" 2>&1)"; then
      pass "$(tail -n 1 <<<"$out")"
    else
      say "$out"; fail "cuda/$variant parity (dense cos < 0.999 or an error above)"
    fi
  done
else
  skip "CUDA: no CUDAExecutionProvider or no GPU"
fi

step "TensorRT warmup-only ($WARMUP_SHAPES), cold then warm"
trt_env=(BGE_M3_EP=tensorrt BGE_M3_WARMUP_ONLY=1 BGE_M3_MODEL_PATH="$EXPORT" BGE_M3_MODEL=fp16
         BGE_M3_CACHE_DIR="$CACHE" BGE_M3_TRT_WARMUP_SHAPES="$WARMUP_SHAPES"
         BGE_M3_MAX_SEQ_LENGTH="$MAX_SEQ" BGE_M3_MAX_CHUNK="$MAX_CHUNK")
if [ "$HAVE_TRT" = 1 ]; then
  for run in cold warm; do
    t0=$(date +%s)
    env "${trt_env[@]}" "$PY" -m bgeserve serve >"$WORK/warmup-$run.log" 2>&1
    rc=$?
    grep -E "trt cache:|warmup-only mode|warm-up [0-9]+x" "$WORK/warmup-$run.log" | tee -a "$REPORT"
    if [ "$rc" -ne 0 ]; then
      tail -n 20 "$WORK/warmup-$run.log"; fail "warmup-only ($run) exited $rc"
    elif [ "$run" = warm ] && ! grep -q "trt cache: found [1-9]" "$WORK/warmup-$run.log"; then
      fail "warmup-only (warm): no 'trt cache: found N' line: the engine was not reused"
    else
      pass "warmup-only ($run): exit 0 in $(elapsed "$t0")s"
    fi
  done
  if out="$(helper parity tensorrt fp16 "$EXPORT" "$CACHE" "$MAX_SEQ" "$MAX_CHUNK" 2>&1)"; then
    pass "$(tail -n 1 <<<"$out")"
  else
    say "$out"; fail "tensorrt/fp16 parity (dense cos < 0.999 or an error above)"
  fi
else
  skip "TensorRT: no TensorrtExecutionProvider or no GPU"
fi

step "throughput (tokens/s, dense + sparse, one session, $ITERS runs per shape)"
say "| EP | variant | shape | first run ms | ms/run | tokens/s |"
say "|---|---|---|---|---|---|"
specs=("cuda fp32 $HAVE_CUDA" "cuda fp16 $HAVE_CUDA" "tensorrt fp16 $HAVE_TRT")
[ "${GPU_CHECK_CPU:-0}" = 1 ] && specs=("cpu fp32 1" "${specs[@]}")
for spec in "${specs[@]}"; do
  read -r ep variant have <<<"$spec"
  if [ "$have" != 1 ]; then
    say "| $ep | $variant | (provider or GPU missing) | | | |"
    continue
  fi
  if ! helper throughput "$ep" "$variant" "$EXPORT" "$CACHE" "$MAX_SEQ" "$MAX_CHUNK" \
      "$SHAPES" "$ITERS" 2>"$WORK/throughput-$ep-$variant.err" | tee -a "$REPORT"; then
    tail -n 5 "$WORK/throughput-$ep-$variant.err"; fail "throughput $ep/$variant"
  fi
done

step "chunk lengths rounded to 32 vs not (one embed() of $ROUND_TEXTS random texts, 16-512 tokens)"
say "| EP | variant | multiple | texts | wall s | tokens/s |"
say "|---|---|---|---|---|---|"
for spec in "cuda fp16 $HAVE_CUDA" "tensorrt fp16 $HAVE_TRT"; do
  read -r ep variant have <<<"$spec"
  [ "$have" = 1 ] || { say "| $ep | $variant | (provider or GPU missing) | | | |"; continue; }
  if ! helper rounding "$ep" "$variant" "$EXPORT" "$CACHE" "$MAX_SEQ" "$MAX_CHUNK" \
      "$ROUND_TEXTS" 2>"$WORK/rounding-$ep.err" | tee -a "$REPORT"; then
    tail -n 5 "$WORK/rounding-$ep.err"; fail "rounding $ep/$variant"
  fi
done

step "summary"
printf '%s\n' "${SUMMARY[@]}"
say "report: $REPORT"
if [ "$FAILED" = 0 ]; then say "GPU CHECK: PASS"; else say "GPU CHECK: FAIL"; fi
exit "$FAILED"
