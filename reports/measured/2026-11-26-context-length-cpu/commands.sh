set -e
# run from the repository root, one command at a time; <scratch>: any scratch directory
R=reports/measured/2026-11-26-context-length-cpu
PY=.venv/bin/python
$PY $R/tokens_by_length.py                                   # tokens_by_length.csv (tokenizing only, about a minute)
# base: the fused-features record's base run (../2026-11-26-fused-features-cpu/commands.sh): the dense draft, one epoch
# on the 6000-conversation cache at max_length 384 (the default's), batch 8 -> <scratch>/base
# long: the first 2000 conversations at max_length 1024, one epoch, batch 3 (about the base's tokens per step)
L="--set data.num_conversations=2000 --set data.max_length=1024"
$PY -m jakiro_lib cache --profile default --run-dir <scratch>/x1024 $L                                  # 11 min
$PY -m jakiro_lib train --profile default --run-dir <scratch>/x1024 --drafts dense $L --set train.epochs=1 --set train.batch_size=3
# both drafts on both held-out sets (crosseval.csv)
$PY $R/crosseval.py <scratch>/base <scratch>/base/drafts/dense/draft <scratch>/x1024/drafts/dense/draft
$PY $R/crosseval.py <scratch>/x1024 <scratch>/base/drafts/dense/draft <scratch>/x1024/drafts/dense/draft
# at the top of the curve: one warm-started epoch from the 10-epoch dense draft (<scratch>/e10, see
# ../2026-11-26-data17k-dense10-cpu/) on the same first 2000 conversations, cut at 384 (short) or 1024 (long)
$PY -m jakiro_lib cache --profile default --run-dir <scratch>/x384 --set data.num_conversations=2000                  # 4.5 min
mkdir -p <scratch>/ws <scratch>/wl && ln -sfn <scratch>/x384/features <scratch>/ws/features && ln -sfn <scratch>/x1024/features <scratch>/wl/features
W="--set train.epochs=1 --set train.lr=5e-4 --set train.init_from=<scratch>/e10"
$PY -m jakiro_lib train --profile default --run-dir <scratch>/wl --drafts dense $L --set train.batch_size=3 $W
$PY -m jakiro_lib train --profile default --run-dir <scratch>/ws --drafts dense --set data.num_conversations=2000 $W
# all three on the 17k cache's 760 held-out conversations (warm.csv; <scratch>/big17: ../2026-11-26-data17k-dense-cpu/)
$PY $R/crosseval.py <scratch>/big17 <scratch>/e10/drafts/dense/draft <scratch>/ws/drafts/dense/draft <scratch>/wl/drafts/dense/draft
