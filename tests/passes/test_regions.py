"""Which modules regional compilation compiles (``passes.regions.find_layers``), on models that are
not HF's: the fallback to a ModuleList of one class, and the whole-model graph when nothing repeats."""

import torch
import torch.nn as nn

import jetrl_compile
from jetrl_compile.passes.regions import find_layers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_module_list_of_one_class_is_the_repeated_layer():
    layers = find_layers(Stack(3))
    assert {cls: [name for name, _ in members] for cls, members in layers.items()} == {
        "Block": ["blocks.0", "blocks.1", "blocks.2"]
    }


def test_regional_compile_of_a_plain_stack_and_the_whole_model_fallback():
    # requires grad, as every later block's input does (else the first block's guards differ)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(0)
    reference = jetrl_compile.unify(Stack(3), "fp8_fwd_bf16_bwd", mode="eager")
    torch.manual_seed(0)
    model = jetrl_compile.unify(Stack(3), "fp8_fwd_bf16_bwd", compiler="aot_eager")
    assert torch.equal(model(x), reference(x))
    state = jetrl_compile.unified_state(model)
    assert state.compiles == 1 and list(state.layer_groups) == ["Block"]
    rows = jetrl_compile.linear_precisions(model)
    assert {m: r["fprop"] for m, r in rows.items()} == {**{f"blocks.{i}.{p}": "fp8" for i in range(3)
                                                           for p in ("up", "down")}, "head": "fp8"}
    assert rows["head"]["source"] == "eager op", "outside the layers, the op runs eagerly"

    single = jetrl_compile.unify(Block(), "fp8_fwd_bf16_bwd", compiler="aot_eager")
    single(x)
    state = jetrl_compile.unified_state(single)
    assert state.layer_groups == {} and state.compiled == [single], "nothing repeats: one whole-model graph"
    rows = jetrl_compile.linear_precisions(single)
    assert {m: (r["fprop"], r["source"]) for m, r in rows.items()} == {m: ("fp8", "graph 0") for m in ("up", "down")}
