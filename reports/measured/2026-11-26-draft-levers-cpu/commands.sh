set -e
# <scratch>/big17: the cache and 5-epoch drafts of ../2026-11-26-data17k-dense-cpu and ../2026-11-26-data17k-jakiro-cpu
# <scratch>/e10: the 10-epoch dense draft of ../2026-11-26-data17k-dense10-cpu
# Each new run directory's features/ is a symlink to <scratch>/big17/features (and features_summary.json a copy).
PY=.venv/bin/python
S10="--set data.num_conversations=17671 --set train.epochs=10"

# 1. tree shape at 8 tokens, the 10-epoch dense draft (depth 4, top-k 4 is the default: ../2026-11-26-data17k-dense10-cpu)
for dk in 6:4 6:2 8:2 5:3 7:1; do d=${dk%:*}; k=${dk#*:}
  $PY -m jakiro_lib bench --profile default --run-dir <scratch>/e10 $S10 --methods vanilla,eagle2 --temperature 0 \
     --set tree.depth=$d --set tree.top_k=$k --out <scratch>/ts/d${d}k${k}
done

# 2. warm starts from the 10-epoch dense draft: one more epoch with two unrolled steps, and its single-step control
F="--set data.num_conversations=17671 --set train.epochs=1 --set train.lr=5e-4 --set train.init_from=<scratch>/e10"
for u in 2 1; do
  $PY -m jakiro_lib train --profile default --run-dir <scratch>/ft/u$u --drafts dense $F --set train.unroll_steps=$u
  $PY -m jakiro_lib bench --profile default --run-dir <scratch>/ft/u$u $F --set train.unroll_steps=$u --methods vanilla,eagle2 --temperature 0 --out <scratch>/ft/u$u/bench
done

# 3. self-distillation: the target's greedy answers to the first 1000 conversations' first user turns (796 kept), cached, then
#    2 epochs from the 10-epoch dense draft
D="--set data.self_distill=true --set data.num_conversations=1000 --set train.epochs=2 --set train.lr=5e-4 --set train.init_from=<scratch>/e10"
$PY -m jakiro_lib cache --profile default --run-dir <scratch>/sd $D
$PY -m jakiro_lib train --profile default --run-dir <scratch>/sd --drafts dense $D
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/sd $D --methods vanilla,eagle2 --temperature 0 --out <scratch>/sd/bench

# 4. the paper's trees (60 tokens, depth 5, top-k 10)
T="--set tree.total_tokens=60 --set tree.depth=5 --set tree.top_k=10"
S5="--set data.num_conversations=17671 --set train.epochs=5"
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/big17 $S5 $T --methods vanilla,eagle2,jakiro,jakiro_cepd --temperature 0 --out <scratch>/pt/both
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/e10 $S10 $T --methods vanilla,eagle2 --temperature 0 --out <scratch>/pt/e10
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/ft/u2 $F --set train.unroll_steps=2 $T --methods vanilla,eagle2 --temperature 0 --out <scratch>/pt/u2
$PY -m jakiro_lib bench --profile default --study ablations --run-dir <scratch>/big17 $S5 $T --methods vanilla,jakiro_coupled_cepd --temperature 0 --out <scratch>/pt/released
# (after `9b2af9a` made names with a comma selectable) coupled candidates without CEPD, and decoupled with "best" scoring
$PY -m jakiro_lib bench --profile default --study ablations --run-dir <scratch>/big17 $S5 $T --methods "vanilla,experts=2, coupled,experts=2, scoring=best" --temperature 0 --out <scratch>/pt/coupled

# 5. Jakiro's draft warm-started with two unrolled steps, at both tree sizes
M="--set data.num_conversations=17671 --set train.epochs=1 --set train.lr=5e-4 --set train.init_from=<scratch>/big17 --set train.unroll_steps=2"
$PY -m jakiro_lib train --profile default --run-dir <scratch>/ftm/u2 --drafts moe2 $M
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/ftm/u2 $M --methods vanilla,jakiro,jakiro_cepd --temperature 0 --out <scratch>/ftm/u2/bench8
$PY -m jakiro_lib bench --profile default --run-dir <scratch>/ftm/u2 $M $T --methods vanilla,jakiro,jakiro_cepd --temperature 0 --out <scratch>/ftm/u2/bench60

# 6. the tables here (drafts.csv, methods.csv, versus_*.csv, acceptance_by_depth*.csv, tree_shape.csv)
$PY reports/measured/2026-11-26-draft-levers-cpu/analysis.py reports/measured/2026-11-26-draft-levers-cpu <scratch>
