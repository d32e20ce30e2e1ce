set -e
# run from the repository root; <dir>: any scratch directory
PY=.venv/bin/python
date -u
$PY -m jakiro_lib cache --profile default --run-dir <dir>/bf16 --set data.cache_batch_size=4
date -u
mkdir -p <dir>/fp32train && ln -sfn <dir>/bf16/features <dir>/fp32train/features
cp <dir>/bf16/features_summary.json <dir>/fp32train/ 2>/dev/null || true
$PY -m jakiro_lib train --profile default --run-dir <dir>/bf16 --drafts dense moe2
# after the autocast fix (see quality.md): the same, into <dir>/bf16fix with <dir>/bf16/features linked
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir>/fp32train --drafts dense moe2 --set train.mixed_precision=no
date -u
