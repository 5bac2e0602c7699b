"""Exact mode end to end: the logprob the unified model gives a token while it samples it (KV-cache
decode through HfEngine) is bitwise the one the trainer recomputes for it teacher-forced inside a
packed GRPO group, for every on-policy recipe, FP32 and BF16 parameters; and what exact mode
refuses, and that restore undoes it."""

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import jetrl_compile
from jetrl_compile.exact import ATTN_IMPLEMENTATION, ExactSiLU
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.logprobs import group_logprobs, token_logprobs
from jetrl_compile.rl.loop import train
from jetrl_compile.rollout.engines import HfEngine
from tests.conftest import ByteTokenizer, tiny_model
from tests.rl.test_grpo import EarnableTask

# hidden 200 and intermediate 320 are not multiples of 128 (partial FP8 blocks); 4 layers
LAYERS = 4
PROMPT_LENGTHS = (5, 17, 11)
NEW_TOKENS = 48


def _model(family="llama", dtype=torch.float32, **overrides):
    return tiny_model(family, layers=LAYERS, dtype=dtype, attn_implementation="sdpa", **overrides).eval()


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _sample_and_recompute(model, n=4, seed=3, new_tokens=NEW_TOKENS):
    """(engine logprobs, trainer logprobs), flat over every sampled token."""
    engine = HfEngine(model, eos_token_id=10_000, pad_token_id=0)  # an EOS never sampled: 48 tokens each
    groups = engine.generate(_prompts(), n=n, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    with torch.no_grad():
        trainer = group_logprobs(model, _prompts(), [[c.token_ids for c in g] for g in groups])
    rollout = torch.tensor([x for g in groups for c in g for x in c.logprobs])
    return rollout, torch.cat(trainer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8_fwd_bf16_bwd", "jetrl"])
def test_sampled_logprobs_are_the_trainers_bit_for_bit(recipe, dtype):
    model = jetrl_compile.unify(_model(dtype=dtype), recipe, exact=True)
    rollout, trainer = _sample_and_recompute(model)
    assert rollout.numel() == len(PROMPT_LENGTHS) * 4 * NEW_TOKENS
    assert torch.equal(rollout, trainer), f"{(rollout != trainer).sum()} of {rollout.numel()} tokens differ"


class _Float64Ops(TorchDispatchMode):
    """Records the ops that produce a float64 tensor, and the largest tensor of each dtype."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
                if t.dtype == torch.float64:
                    self.ops.add(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize(
    ("recipe", "dtype"), [("jetrl", torch.bfloat16), ("bf16", torch.float32)], ids=["jetrl-bf16", "bf16-fp32"]
)
def test_on_a_gpus_kernels_exact_mode_needs_no_float64(recipe, dtype, monkeypatch):
    """With a GPU's kernels (here under Triton's interpreter): the Triton FP8 GEMM for quantized
    linears and ``triton_invariant``'s GEMM, RMSNorm, attention and log-softmax for the rest.
    Sampled logprobs are still the trainer's bit for bit, and once the weights are quantized (the
    scales' float64 arithmetic, once per optimizer step) neither sampling nor the trainer's
    recompute runs a float64 GEMM or makes a float64 tensor bigger than the activations' scales
    (one value per 128-group, which torchao computes in float64): no fixed-point operand."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "triton")
    model = tiny_model(layers=2, dtype=dtype, attn_implementation="sdpa").eval()
    model = jetrl_compile.unify(model, recipe, exact=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([_prompts()[0]]))  # quantizes the weights
    with _Float64Ops() as float64:
        rollout, trainer = _sample_and_recompute(model, n=2, new_tokens=10)  # the interpreter is slow
    assert rollout.numel() == len(PROMPT_LENGTHS) * 2 * 10
    assert torch.equal(rollout, trainer), f"{(rollout != trainer).sum()} of {rollout.numel()} tokens differ"
    assert not float64.ops & {"mm", "bmm", "addmm", "matmul", "baddbmm"}, float64.ops
    assert float64.largest.get(torch.float64, 0) * 128 <= max(float64.largest.values()), float64.largest
    assert not jetrl_compile.unified_state(model).cache._fixed, "no weight has a fixed-point operand"


def test_qwen2_with_biases_is_exact_too():
    model = jetrl_compile.unify(_model("qwen2"), "fp8_fwd_bf16_bwd", exact=True)
    rollout, trainer = _sample_and_recompute(model, n=2)
    assert torch.equal(rollout, trainer)


def test_without_exact_mode_these_inputs_do_differ():
    """The inputs above exercise what exact mode fixes: the same flow without it is not bitwise
    (decode and the packed forward run shapes through kernels whose rounding depends on shape)."""
    model = jetrl_compile.unify(_model(), "fp8_fwd_bf16_bwd", mode="eager")
    rollout, trainer = _sample_and_recompute(model)
    assert not torch.equal(rollout, trainer)


def test_off_policy_recipe_stays_off_policy_in_exact_mode():
    model = jetrl_compile.unify(_model(), "fp8_rollout_only", exact=True)
    rollout, trainer = _sample_and_recompute(model, n=2)
    assert (rollout - trainer).abs().mean() > 1e-3  # BF16 trainer vs FP8 sampler: two functions


def test_packing_and_batching_do_not_change_a_token():
    model = jetrl_compile.unify(_model(), "jetrl", exact=True)
    prompts = _prompts()
    g = torch.Generator().manual_seed(5)
    groups = [[torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 1, 30)] for _ in prompts]
    with torch.no_grad():
        packed = group_logprobs(model, prompts, groups)
        alone = [lp for p, grp in zip(prompts, groups) for c in grp for lp in token_logprobs(model, [p], [c])]
        pairs = token_logprobs(model, [prompts[2], prompts[0]], [groups[2][0], groups[0][2]])
    for a, b in zip(packed, alone):
        assert torch.equal(a, b)
    assert torch.equal(pairs[0], packed[6]) and torch.equal(pairs[1], packed[2])


def test_gradients_flow_and_match_the_non_exact_ones():
    prompts, completions = _prompts()[:2], [[7, 8, 9, 10], [3, 4]]
    grads = []
    for exact in (True, False):
        model = jetrl_compile.unify(_model(), "fp8_fwd_bf16_bwd", mode="eager", exact=exact)
        loss = sum(lp.sum() for lp in token_logprobs(model, prompts, completions))
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(g, grads[1][name], rtol=0.1, atol=2e-3 * grads[1][name].abs().max().item())


def test_exact_refuses_compile_and_unsupported_models():
    with pytest.raises(ValueError, match="runs eagerly"):
        jetrl_compile.unify(_model(), exact=True, mode="compile")
    with pytest.raises(ValueError, match="activation GELU.*exact=False"):
        jetrl_compile.unify(_model(hidden_act="gelu_pytorch_tanh"), exact=True)
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        jetrl_compile.unify(_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                            exact=True)


def test_restore_undoes_exact_mode():
    model = _model()
    ids = torch.randint(1, 256, (2, 9))
    before = model(ids).logits
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", exact=True)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert isinstance(model.model.layers[0].mlp.act_fn, ExactSiLU)
    jetrl_compile.restore(model)
    assert model.config._attn_implementation == "sdpa"
    assert not isinstance(model.model.layers[0].mlp.act_fn, ExactSiLU)
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(ids).logits, before)


def _exact_cfg(tmp_path, **kw):
    return GrpoConfig(**{**dict(steps=2, batch_size=2, group_size=3, max_new_tokens=8, lr=1e-2, engine="hf",
                                out=str(tmp_path / "run"), save_every=5, plot_every=5, micro_batch=3, exact=True),
                         **kw})


def test_grpo_driver_exact_reports_zero_mismatch_every_step(tmp_path):
    model = tiny_model("llama", layers=2)
    rows = train(_exact_cfg(tmp_path), model=model, tokenizer=ByteTokenizer(), task=EarnableTask(seed=0),
                 progress=False)
    assert len(rows) == 2
    for row in rows:
        assert row["grad_norm"] > 0  # the steps learn, so the second step samples updated weights
        assert row["mismatch_kl"] == 0.0 and row["logprob_abs_diff_max"] == 0.0, row


def test_grpo_driver_warns_loudly_on_a_step_that_is_not_exact(tmp_path, monkeypatch, caplog):
    real = HfEngine.generate

    def off_by_an_ulp(self, *args, **kwargs):
        groups = real(self, *args, **kwargs)
        c = groups[1][2]
        c.logprobs[3] = float(torch.nextafter(torch.tensor(c.logprobs[3]), torch.tensor(0.0)))
        return groups

    monkeypatch.setattr(HfEngine, "generate", off_by_an_ulp)
    with caplog.at_level(logging.WARNING, logger="jetrl_compile.grpo"):
        train(_exact_cfg(tmp_path, steps=1), model=tiny_model("llama", layers=2), tokenizer=ByteTokenizer(),
              task=EarnableTask(seed=0), progress=False)
    assert "step 1 is NOT exact: prompt 1, sample 2 first differs at token 3" in caplog.text


@pytest.mark.slow
def test_default_model_exact_over_2000_sampled_tokens():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from mismatch import prompts_for

    from jetrl_compile.models import load_model
    from jetrl_compile.rl.mismatch import rollout_mismatch

    model, tok = load_model(dtype=torch.float32)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", exact=True)
    m = rollout_mismatch(model, HfEngine(model, tokenizer=tok), prompts_for(tok, 24), n=4, max_new_tokens=64,
                         pad_token_id=tok.pad_token_id or 0, seed=7)
    assert m["tokens"] >= 2000, m
    assert m["logprob_abs_diff_max"] == 0.0 and m["mismatch_kl"] == 0.0, m
