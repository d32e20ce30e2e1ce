"""tokens_by_length.csv (README.md beside this file): tokens and answer (loss) tokens that the default profile's data
keeps at each max_length, over all 17,671 packaged ShareGPT conversations: `python tokens_by_length.py`."""
import csv
from pathlib import Path

from transformers import AutoTokenizer

from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import load_conversations
from jakiro_lib.data.features import tokenize_conversation
from jakiro_lib.models.target import builtin_smollm2_path

profile = get_profile("default")
tokenizer = AutoTokenizer.from_pretrained(builtin_smollm2_path())
convs = load_conversations(profile.data.source, path=profile.data.path, limit=17_671)
full = [tokenize_conversation(tokenizer, c, None, profile.target.template) for c in convs]
with open(Path(__file__).with_name("tokens_by_length.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["max_length", "conversations", "tokens", "answer_tokens", "answer_share_of_all"])
    total_answers = sum(sum(m) for _, m in full)
    for n in (384, 512, 768, 1024, 1536, 2048, None):
        kept = [(i, m) for i, m in full if sum(m[:n]) > 0]  # as the cache: a conversation with no answer in reach is skipped
        answers = sum(sum(m[:n]) for _, m in kept)
        w.writerow([n or "none", len(kept), sum(len(i[:n]) for i, _ in kept), answers, f"{answers / total_answers:.3f}"])
print(open(Path(__file__).with_name("tokens_by_length.csv")).read())
