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
# the loss on user turns too, one warm-started epoch from the 10-epoch dense draft of ../2026-11-26-data17k-dense10-cpu/
# (<scratch>/e10; <scratch>/ft/u1, its control on the answers only, is step 2 of ../2026-11-26-draft-levers-cpu/commands.sh)
mkdir -p <scratch>/ft/all1 && ln -sfn <scratch>/big17/features <scratch>/ft/all1/features
LEVER=allmask $PY reports/measured/2026-11-26-training-levers2-cpu/levers.py train --profile default --run-dir <scratch>/ft/all1 \
    --drafts dense --set data.num_conversations=17671 --set train.epochs=1 --set train.lr=5e-4 --set train.init_from=<scratch>/e10 \
    --set train.unroll_steps=1
$PY $R/table.py <scratch>
