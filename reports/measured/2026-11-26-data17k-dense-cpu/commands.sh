set -e
# run from the repository root; <dir>: any scratch directory
PY=.venv/bin/python
S="--set data.num_conversations=17671 --set train.epochs=5"
date -u
$PY -m jakiro_lib cache --profile default --run-dir <dir> $S
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir> --drafts dense $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir> $S --methods vanilla,eagle2 --temperature 0 --out <dir>/bench_dense
date -u
