"""Warm starts: a graph compiled before comes from AOTAutograd's cache, and its precision report
is still complete (the records stored by the compile that read them off the graphs)."""

import shutil
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import fresh_cache

import jetrl_compile
from tests.conftest import tiny_model


def _train_once(recipe: str):
    """A fresh tiny model, unified and compiled, one forward and backward: logits, gradients, the
    report and AOTAutograd's cache counters of this compile."""
    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, recipe, dynamic=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    counters.clear()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return out.logits.detach(), grads, jetrl_compile.precision_report(model), dict(counters["aot_autograd"])


def _linears(report: list[dict]) -> list[dict]:
    return [row for graph in report for row in graph["linears"]]


def _without_cache_flag(report: list[dict]) -> list[dict]:
    return [{k: v for k, v in graph.items() if k != "from_cache"} for graph in report]


def test_a_graph_compiled_before_comes_from_aot_autograds_cache_with_its_report():
    with fresh_cache():
        logits, grads, report, aot = _train_once("fp8_fwd_bf16_bwd")
        # AOTAutograd accepted the graph calling fp8_linear (it bypasses graphs it cannot vouch for)
        assert aot.get("autograd_cache_saved", 0) == 1 and not aot.get("autograd_cache_bypass"), aot
        # one AOTAutograd trace: under dynamic=True Dynamo would trace RMSNorm's float epsilon as a
        # symbol, fail to turn it into a tensor after that trace, and trace again (DYNAMO_OPTIONS)
        assert aot["total"] == 1, aot
        assert not any(graph["from_cache"] for graph in report)
        rows = _linears(report)
        assert len(rows) == 14 and all(row["fprop"] == "fp8" and row["wgrad"] == "bf16" for row in rows), rows

        warm_logits, warm_grads, warm_report, aot = _train_once("fp8_fwd_bf16_bwd")
        assert aot.get("autograd_cache_hit", 0) == 1, aot
        assert all(graph["from_cache"] for graph in warm_report)
        assert _without_cache_flag(warm_report) == _without_cache_flag(report)
        assert torch.equal(warm_logits, logits)
        assert all(torch.equal(a, b) for a, b in zip(warm_grads, grads, strict=True))

        # the records gone: AOTAutograd's cache still serves the graph, which then compiles again
        # with that cache off, and the records are read off anew
        shutil.rmtree(Path(cache_dir()) / "jetrl_precisions")
        _, _, again, aot = _train_once("fp8_fwd_bf16_bwd")
        assert aot.get("autograd_cache_hit") == 1 and aot["total"] == 2, aot
        assert not any(graph["from_cache"] for graph in again)
        assert _without_cache_flag(again) == _without_cache_flag(report)

        # another recipe is another graph: no hit, its own report
        _, _, other, aot = _train_once("bf16")
        assert not aot.get("autograd_cache_hit") and all(row["fprop"] == "bf16" for row in _linears(other)), aot


def test_a_graph_traced_on_the_other_bf16_gemm_path_is_not_served_from_the_cache(monkeypatch):
    """Which BF16 GEMM the op runs is read when the graph is traced; a ``bf16`` graph calls the op
    with the same arguments on both paths, so the path must be part of AOTAutograd's key."""
    with fresh_cache():
        monkeypatch.setenv("JETRL_BF16_GEMM", "native")
        _train_once("bf16")
        monkeypatch.setenv("JETRL_BF16_GEMM", "fp32")
        _, _, report, aot = _train_once("bf16")
        assert not aot.get("autograd_cache_hit"), aot
        assert {graph["bf16_gemm"] for graph in report} == {"fp32"}
