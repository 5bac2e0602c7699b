"""The trainer's packed group forward computes the function of G separate sequences, prompt once."""

import pytest
import torch

import jetrl_compile
from jetrl_compile.rl.logprobs import group_logprobs, token_logprobs
from tests.conftest import tiny_model

# prompts of different lengths; groups with different sizes, lengths and an empty completion
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5], [9]]
GROUPS = [[[1, 2, 3], [4], [9, 9, 9, 9, 9, 9]], [[7, 7], [8, 8, 8, 8], []], [[1, 1, 1]]]


def _alone(model, prompt, completion) -> torch.Tensor:
    """The reference: one unpadded sequence through the model's plain forward."""
    ids = torch.tensor([prompt + completion])
    logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)
    targets = torch.tensor(completion, dtype=torch.long)
    return logprobs[len(prompt) - 1 : -1].gather(-1, targets[:, None]).squeeze(-1)


def _flat(prompts, groups):
    return [(p, c) for p, g in zip(prompts, groups) for c in g]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_groups_equal_separate_sequences_with_their_gradients(family):
    model = tiny_model(family, layers=2, dtype=torch.float64)
    packed = group_logprobs(model, PROMPTS, GROUPS)
    assert [len(x) for x in packed] == [len(c) for _, c in _flat(PROMPTS, GROUPS)]
    torch.cat(packed).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    alone = [_alone(model, p, c) for p, c in _flat(PROMPTS, GROUPS) if c]
    torch.cat(alone).sum().backward()
    torch.testing.assert_close(torch.cat(packed), torch.cat(alone), rtol=0, atol=1e-12)
    for name_param, got in zip(model.named_parameters(), packed_grads):
        name, param = name_param
        assert param.grad.abs().sum() > 0, name  # every weight is exercised
        # log_softmax runs in float32 (as in training): the shared row's backward rounds once, the
        # separate rows' backwards G times, so float32 rounding, not float64, bounds the gradients
        torch.testing.assert_close(got, param.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_each_prompt_runs_once_per_group():
    model = tiny_model("llama", layers=1)
    rows = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:2]))
    prompts, groups = [[1] * 10, [2] * 8], [[[3] * 4] * 6, [[4] * 3] * 6]  # G = 6 short completions
    with torch.no_grad():
        group_logprobs(model, prompts, groups)
    assert rows == [torch.Size([2, 10 + 6 * 4])]  # longest prompt + longest group, per row
    assert rows[0].numel() < 0.55 * sum(len(p) + len(c) for p, g in zip(prompts, groups) for c in g)


def test_token_logprobs_is_the_one_completion_group():
    model = tiny_model("llama", layers=2, dtype=torch.float64)
    prompts, completions = [p for p, c in _flat(PROMPTS, GROUPS)], [c for _, c in _flat(PROMPTS, GROUPS)]
    got = token_logprobs(model, prompts, completions)
    for (p, c), x in zip(_flat(PROMPTS, GROUPS), got):
        torch.testing.assert_close(x, _alone(model, p, c) if c else torch.zeros(0, dtype=x.dtype), rtol=0, atol=1e-12)


def test_eager_attention_takes_the_additive_mask():
    model = tiny_model("llama", layers=2, dtype=torch.float64)
    sdpa = group_logprobs(model, PROMPTS, GROUPS)
    model.config._attn_implementation = "eager"  # its softmax runs in float32
    eager = group_logprobs(model, PROMPTS, GROUPS)
    torch.testing.assert_close(torch.cat(eager), torch.cat(sdpa), rtol=0, atol=1e-5)


def test_attention_without_custom_masks_and_bad_input_are_refused():
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="3 prompts but 2 groups"):
        group_logprobs(model, PROMPTS, GROUPS[:2])
    with pytest.raises(ValueError, match="empty prompt"):
        group_logprobs(model, [[]], [[[1]]])
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        group_logprobs(model, PROMPTS, GROUPS)


def test_sequences_beyond_a_sliding_window_are_refused():
    model = tiny_model("mistral", layers=1, sliding_window=8)
    group_logprobs(model, [[1, 2, 3]], [[[4, 5, 6, 7, 8]]])  # 8 tokens: inside the window
    with pytest.raises(ValueError, match="sliding window of 8"):
        group_logprobs(model, [[1, 2, 3]], [[[4, 5, 6, 7, 8, 9]]])


def test_compiled_unified_model_packs_like_eager_without_recompiling():
    eager = jetrl_compile.unify(tiny_model("llama", layers=2), "fp8_fwd_bf16_bwd", mode="eager")
    compiled = jetrl_compile.unify(tiny_model("llama", layers=2), "fp8_fwd_bf16_bwd", mode="compile", dynamic=True,
                                   compiler="aot_eager")  # Dynamo and AOTAutograd trace the mask and kept rows
    compiles = []
    for prompts, groups in [(PROMPTS, GROUPS), (PROMPTS[:2], [[[1, 2]], [[3], [4, 5, 6, 7]]])]:
        want = torch.cat(group_logprobs(eager, prompts, groups))
        got = torch.cat(group_logprobs(compiled, prompts, groups))
        torch.testing.assert_close(got, want, rtol=0, atol=0.05)  # FP8 rounding may flip differently
        got.sum().backward()
        compiles.append(jetrl_compile.unified_state(compiled).compiles)
    assert compiles[0] == compiles[1] >= 1  # other packed shapes reuse the graph
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in compiled.parameters() if p.dim() == 2)
