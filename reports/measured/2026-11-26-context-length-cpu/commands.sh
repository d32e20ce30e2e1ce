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
