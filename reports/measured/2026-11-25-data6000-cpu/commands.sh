set -e
# run from the repository root; <dir>: any scratch directory
PY=.venv/bin/python
S="--set data.num_conversations=6000 --set train.epochs=4"
date -u
$PY -m jakiro_lib cache --profile default --run-dir <dir>/c6000 $S
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir>/c6000 --drafts dense $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir>/c6000 $S --methods vanilla,eagle2 --temperature 0 --out <dir>/c6000/bench_dense
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir>/c6000 --drafts moe2 $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir>/c6000 $S --methods vanilla,eagle2,jakiro --temperature 0 --out <dir>/c6000/bench_tau
date -u
