set -e
# run from the repository root; <dir>: any scratch directory
PY=.venv/bin/python
S="--set data.num_conversations=2000 --set train.epochs=4"
date -u
$PY -m jakiro_lib cache --profile default --run-dir <dir>/c2000 $S
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir>/c2000 --drafts dense moe2 $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir>/c2000 $S --methods vanilla,eagle2,jakiro --temperature 0 --out <dir>/c2000/bench_tau
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir>/bf16 --methods vanilla,eagle2,jakiro --temperature 0 --out <dir>/bf16/bench_tau
date -u
