"""HfEngine samples with the recipe's rollout forward: the trainer's own for on-policy recipes,
the FP8 op for the off-policy baseline."""

import torch

import jetrl_compile
from jetrl_compile.rollout.engines import HfEngine
from tests.conftest import tiny_model

PROMPTS = [[1 + i, 7 + 2 * i, 30 + i, 99 - i] for i in range(4)]


def _sample(recipe: str, mode: str = "eager"):
    model = jetrl_compile.unify(tiny_model("llama", layers=2), recipe, mode=mode, compiler="aot_eager") \
        if mode == "compile" else jetrl_compile.unify(tiny_model("llama", layers=2), recipe, mode=mode)
    groups = HfEngine(model).generate(PROMPTS, n=2, max_new_tokens=10, seed=3)
    return model, [c.token_ids for g in groups for c in g], torch.tensor(
        [x for g in groups for c in g for x in c.logprobs]
    )


def test_fp8_rollout_only_samples_with_the_fp8_forward_and_trains_in_bf16():
    _, fp8_tokens, fp8_logprobs = _sample("fp8_fwd_bf16_bwd")  # FP8 forward: the rollout of both
    _, bf16_tokens, bf16_logprobs = _sample("bf16")
    model, tokens, logprobs = _sample("fp8_rollout_only")
    assert tokens == fp8_tokens and torch.equal(logprobs, fp8_logprobs)
    assert (tokens, logprobs.tolist()) != (bf16_tokens, bf16_logprobs.tolist())  # and not the BF16 one

    # after sampling, the model trains with its BF16 forward again
    ids = torch.tensor([PROMPTS[0]])
    bf16_model = jetrl_compile.unify(tiny_model("llama", layers=2), "bf16", mode="eager")
    assert torch.equal(model(input_ids=ids).logits, bf16_model(input_ids=ids).logits)


def test_compiled_fp8_rollout_only_samples_fp8_and_keeps_its_compiled_forward():
    _, fp8_tokens, fp8_logprobs = _sample("fp8_fwd_bf16_bwd")
    model, tokens, logprobs = _sample("fp8_rollout_only", mode="compile")
    assert tokens == fp8_tokens and torch.equal(logprobs, fp8_logprobs)
    state = jetrl_compile.unified_state(model)
    assert state.compiled and all(layer._compiled_call_impl is not None for layer in state.compiled)
    before = state.compiles
    model(input_ids=torch.tensor([PROMPTS[0]]), use_cache=False)
    assert state.compiles > before  # the training forward (grad on, no cache) still runs compiled


def test_temperature_zero_is_greedy_for_every_copy():
    model = jetrl_compile.unify(tiny_model("llama", layers=2), "fp8_fwd_bf16_bwd", mode="eager")
    groups = HfEngine(model).generate(PROMPTS[:2], n=3, max_new_tokens=6, temperature=0.0)
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(c.token_ids) for c in group}) == 1  # every copy greedy, so all equal
        ids = torch.tensor([prompt])
        with torch.no_grad():
            first = model(input_ids=ids).logits[0, -1].argmax().item()
        assert group[0].token_ids[0] == first
