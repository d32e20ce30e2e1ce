set -e
# <dir>: a scratch directory whose features/ (and features_summary.json) are the cache of
# ../2026-11-26-data17k-dense-cpu/commands.sh (all 17,671 packaged conversations); here a symlink to it
PY=.venv/bin/python
S="--set data.num_conversations=17671 --set train.epochs=10"
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir> --drafts dense $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir> $S --methods vanilla,eagle2,eagle2_auto --temperature 0 --out <dir>/bench_dense
date -u
