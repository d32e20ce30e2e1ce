set -e
# run from the repository root, after ../2026-11-26-data17k-dense-cpu/commands.sh in the same <dir>
# (its cache of all 17,671 packaged conversations and its dense draft)
PY=.venv/bin/python
S="--set data.num_conversations=17671 --set train.epochs=5"
date -u
$PY -m jakiro_lib train --profile default --run-dir <dir> --drafts moe2 $S
date -u
$PY -m jakiro_lib bench --profile default --run-dir <dir> $S --methods vanilla,eagle2,jakiro,jakiro_cepd,eagle2_auto,jakiro_auto --temperature 0 --out <dir>/bench_both
date -u
$PY -m jakiro_lib bench --profile default --study ablations --run-dir <dir> $S --methods vanilla,jakiro_coupled_cepd --temperature 0 --out <dir>/bench_released
date -u
