"""TRL's GRPOTrainer on the unified flow (jetrl_compile.integrations.trl), two steps on a tiny
model: the recipe's precision in the graphs TRL trains through, and TRL's own mismatch metric
at the unified flow's level (and far above it for the off-policy baseline)."""

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
from datasets import Dataset  # noqa: E402  (the trl extra: installed by make venv, so never skipped)
from trl import GRPOConfig  # noqa: E402

import jetrl_compile  # noqa: E402
from jetrl_compile.integrations.trl import MISMATCH_METRICS, UnifiedGRPOTrainer  # noqa: E402

from ..conftest import VLLM_TINY, tiny_model, word_tokenizer  # noqa: E402

MEAN, MAX = MISMATCH_METRICS


def low_ids_reward(completions, **_):
    """The fraction of a completion's words that are tokens below 128: graded, so a group's
    rewards differ and the first step has a nonzero gradient on any CPU's samples."""
    return [sum(int(w[1:]) < 128 for w in c.split()) / max(1, len(c.split())) for c in completions]


def run_trl(model, tmp_path, *, use_vllm: bool, steps: int = 2, **settings):
    """``steps`` TRL GRPO steps (2 prompts x 4 completions x 8 tokens); the trainer and a copy of
    one projection's weight from before training."""
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "w3"
    data = Dataset.from_list([{"prompt": " ".join(f"w{(7 * i + j) % 200 + 10}" for j in range(5))} for i in range(16)])
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, bf16=False, use_vllm=use_vllm, vllm_mode="colocate",
        logging_steps=1, report_to=[], save_strategy="no", seed=0, **settings,
    )
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer = UnifiedGRPOTrainer(model=model, reward_funcs=low_ids_reward, args=args, train_dataset=data,
                                 processing_class=tokenizer)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, before


def untrained_trainer(model, tmp_path, **settings):
    """The host set up around ``model`` (one prompt, TRL's defaults otherwise), not trained."""
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, report_to=[], **settings)
    return UnifiedGRPOTrainer(model=model, reward_funcs=low_ids_reward, processing_class=word_tokenizer(),
                              args=args, train_dataset=Dataset.from_list([{"prompt": "w5 w6"}]))


def logged_steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "reward" in h]


def test_trl_generate_samples_and_trains_on_the_recipes_graphs(tmp_path):
    """use_vllm=False: TRL's generate and its training step both run the compiled unified model;
    the graphs TRL trained through run every projection's fprop in FP8 and its dgrad and wgrad
    in BF16."""
    model = tiny_model("llama", layers=2, dtype=torch.float32, **VLLM_TINY)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager", dynamic=True)
    trainer, before = run_trl(model, tmp_path, use_vllm=False, gradient_checkpointing=False)

    steps = logged_steps(trainer)
    assert len(steps) == 2 and steps[0]["grad_norm"] > 0
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight), "the optimizer moved the weights"
    assert not any(k.startswith("sampling/") for s in steps for k in s), "TRL keeps no sampler logprobs here"
    trained = [r for r in jetrl_compile.precision_report(model) if r["backward_compiled"]]
    rows = [row for report in trained for row in report["linears"]]
    # TRL's fused LM head multiplies by lm_head.weight itself: the head is no module call here
    projections = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert {row["module"] for row in rows} == projections and len(projections) == 2 * 7
    for row in rows:
        assert (row["fprop"], row["dgrad"], row["wgrad"]) == ("fp8", "bf16", "bf16"), row


@pytest.mark.parametrize("recipe", ["fp8_fwd_bf16_bwd", "fp8_rollout_only"])
def test_trl_colocated_vllm_logs_the_flows_mismatch(recipe, tmp_path):
    """use_vllm=True: our FP8 engine samples for TRL and is synced after each step. TRL's own
    ``sampling/sampling_logp_difference`` is float32 rounding for the unified flow (vLLM's linears
    are the trainer's, the rest runs in FP32 on both sides), on the step after the weights moved
    as on the first, and about 1e-2 for FP8 rollout beside an FP32 trainer."""
    model = jetrl_compile.unify(tiny_model("llama", layers=2, dtype=torch.float32, **VLLM_TINY), recipe, mode="eager")
    trainer, before = run_trl(model, tmp_path, use_vllm=True)

    steps = logged_steps(trainer)
    assert len(steps) == 2 and steps[0]["grad_norm"] > 0
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight), "step 2 samples from moved weights"
    if recipe == "fp8_fwd_bf16_bwd":
        assert all(s[MAX] < 1e-5 for s in steps), [s[MAX] for s in steps]
    else:
        assert all(s[MEAN] > 1e-3 for s in steps), [s[MEAN] for s in steps]


@pytest.mark.parametrize("change, message", [
    (dict(bf16=True, use_cpu=True), "bf16=True runs the forward under autocast"),
    (dict(use_vllm=True, vllm_mode="server"), "vllm_mode='server'"),
    (dict(use_vllm=True, vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode=False"),
    (dict(gradient_checkpointing=True, unify=dict(mode="compile", regional=False)),
     "recomputes each layer outside the whole-model compiled"),
    (dict(unify=dict(include_lm_head=True)), "its own fused head"),
    # any peft_config is refused before TRL reads it (so no PEFT install is needed here)
    (dict(trainer=dict(peft_config=object())), "PEFT adapters are not in the recipe"),
    (dict(use_vllm=True, vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=1"),
])
def test_settings_that_leave_the_recipe_are_refused_by_name(change, message, tmp_path):
    change = dict(change)
    options = {"mode": "eager", "compiler": "aot_eager", **change.pop("unify", {})}
    trainer_kwargs = change.pop("trainer", {})
    model = jetrl_compile.unify(tiny_model("llama", layers=1), "fp8_fwd_bf16_bwd", **options)
    args = GRPOConfig(output_dir=str(tmp_path), **{"bf16": False, **change})
    with pytest.raises(ValueError, match=message):
        UnifiedGRPOTrainer(model=model, reward_funcs=low_ids_reward, args=args, **trainer_kwargs)


def test_gradient_checkpointing_is_accepted_with_regional_compile(tmp_path):
    """Regional compile recomputes the compiled layer under checkpointing, so the recipe holds
    (tests/test_unify.py::test_the_recipe_holds_under_gradient_checkpointing): only the
    whole-model compile is refused with TRL's default gradient_checkpointing=True."""
    model = jetrl_compile.unify(tiny_model("llama", layers=1), "fp8_fwd_bf16_bwd", compiler="aot_eager")
    assert jetrl_compile.unified_state(model).layer_groups, "compiled per layer"
    untrained_trainer(model, tmp_path, gradient_checkpointing=True).close()


def test_more_than_one_process_is_refused(tmp_path, monkeypatch):
    """Under accelerate/torchrun the host would train each rank's copy alone: refused once TRL
    has set up its accelerator. Two processes are simulated by the accelerator's count, so no
    process is started."""
    import accelerate

    model = jetrl_compile.unify(tiny_model("llama", layers=1), "fp8_fwd_bf16_bwd", mode="eager")
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match="runs in one process for now"):
        untrained_trainer(model, tmp_path)


def test_a_model_that_is_not_unified_is_refused():
    with pytest.raises(ValueError, match=r"jetrl_compile.unify\(model"):
        UnifiedGRPOTrainer(model=tiny_model("llama", layers=1), reward_funcs=low_ids_reward)
    with pytest.raises(ValueError, match="not 'HuggingFaceTB/SmolLM2-135M'"):
        UnifiedGRPOTrainer(model="HuggingFaceTB/SmolLM2-135M", reward_funcs=low_ids_reward)


def test_a_trl_without_the_internals_the_host_uses_is_named(monkeypatch):
    from jetrl_compile.integrations import trl as host

    monkeypatch.setattr(host, "_TRL_HOOKS", (*host._TRL_HOOKS, "_no_such_hook"))
    with pytest.raises(RuntimeError, match=r"written for TRL 1\.16\.0.*has no GRPOTrainer\._no_such_hook"):
        host._check_trl(object())


def test_left_padded_rows_are_numbered_from_their_first_token(tmp_path):
    """GRPOTrainer scores left-padded prompts without position ids; while the host trains, the
    model numbers each row from its first token (vLLM's positions), the first pad otherwise."""
    model = jetrl_compile.unify(tiny_model("llama", layers=1), "fp8_fwd_bf16_bwd", mode="eager")
    seen = []
    model.model.rotary_emb.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"].clone()),
                                                     with_kwargs=True)
    ids = torch.randint(3, 256, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    trainer = untrained_trainer(model, tmp_path)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        trainer.close()
        model(input_ids=ids, attention_mask=mask)
    assert seen[0].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert seen[1].tolist() == [[0, 1, 2, 3, 4, 5]], "closing the trainer takes the hook off"
