set -e
# run from the repository root, one command at a time; <scratch>: any scratch directory. <scratch>/c6000 is the
# 6000-conversation default-profile cache of ../2026-11-25-data6000-cpu/ (`cache --profile default
# --set data.num_conversations=6000`); each run directory links to its features/.
R=reports/measured/2026-11-26-fused-features-cpu
PY=.venv/bin/python
S="--set data.num_conversations=6000 --set train.epochs=1"
$PY $R/side.py <scratch>/c6000/features <scratch>/side 2 15        # 495 s: 1.89M tokens
for d in base fused base_u2 fused_u2; do mkdir -p <scratch>/$d && ln -sfn <scratch>/c6000/features <scratch>/$d/features; done
$PY $R/fused.py train --profile default --run-dir <scratch>/base --drafts dense $S
SIDE=<scratch>/side $PY $R/fused.py train --profile default --run-dir <scratch>/fused --drafts dense $S
$PY $R/fused.py train --profile default --run-dir <scratch>/base_u2 --drafts dense_u2 $S
SIDE=<scratch>/side $PY $R/fused.py train --profile default --run-dir <scratch>/fused_u2 --drafts dense_u2 $S
$PY $R/table.py <scratch>
