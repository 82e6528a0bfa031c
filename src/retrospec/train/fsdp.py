"""Sharding the frozen target with FSDP2 (``torch.distributed.fsdp.fully_shard``) for the distillers' ``--fsdp``:
``retrospec train longspec-distill`` / ``draft-distill`` under ``torchrun`` / ``accelerate launch`` with N > 1
processes (``train.distributed``).

Without it every process holds the whole target. With it each process holds 1/N of the target's decoder layers
(the bulk of a large model: about 97% of a 70B Llama's parameters) and gathers one layer at a time, in every forward:

- **units**: ``fully_shard`` on each decoder layer, then on the decoder (``get_decoder()``), the root of every
  forward the distillers run (they call the decoder, never the causal LM's own forward: with the causal LM as the
  root, the decoder called by itself meets its embedding still sharded, "aten.embedding.default got mixed
  torch.Tensor and DTensor"). Each layer's parameters are all-gathered before its forward and freed after it
  (``reshard_after_forward``); the frozen target has no gradient, so nothing is reduce-scattered.
- **kept whole on every process**: what lies outside the layers (the input embedding, the final norm, the output
  head; ``ignored_params`` of the decoder's unit). The distillers read them outside the target's forward: the
  LongSpec block embeds its own tokens with the target's embedding module and drafts through rows of its head; the
  draft distiller copies embedding and head rows when it re-chooses the vocabulary; both evaluate with the head.
  Sharded, each read would need a gather of its own.
- **the trained model (block or draft) is not sharded**: it stays data-parallel exactly as without ``--fsdp``
  (``Dist.sum_grads``: one all-reduce of the token-weighted gradients per step, every process holding the whole
  model and optimiser). It is small by design (one layer; a 135M draft), so sharding it would save little, while
  keeping it whole keeps what makes N processes train as one: the one-process loss and gradient of every batch (a
  parameter no process gave a gradient stays ``None``), clipping on the whole gradient, and checkpoints and
  ``resume.pt`` written from the model's own state dict by rank 0, identical in layout to one process's (the target
  is never written, so no full state dict has to be gathered). FSDP2 on a trained module also runs on the CPU with
  gloo (forward, backward with its reduce-scatter, AdamW, ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``), so sharding the student as well remains possible; it is not needed here.
- **every process runs every forward of the target**: an all-gather needs all processes (one that skipped a forward
  would leave the others waiting for ever). A process whose slice of a batch is empty (``Dist.rows``) runs the target
  alone on the batch's first row, without gradient, and discards it (``Dist.local_loss``; transformers' decoders
  refuse zero rows: "cannot reshape tensor of 0 elements"); evaluation, the precision measurement and the curve
  points already run on every process.
- **a private target**: a target the caller passed in is never changed. Its decoder layers are deep-copied and the
  copy is sharded (the copy shares the caller's embedding, norm and head modules, which sharding leaves alone);
  ``retrospec``'s own target (loaded by the distiller) is sharded in place and dropped from ``load_model``'s cache, so
  no later ``load_model`` in the process receives a sharded model.
- **devices**: on the CPU the mesh is ``init_device_mesh("cpu", (N,))`` over gloo. With ``--device cuda`` the
  distiller loads its target on the CPU (host memory holds it whole for a moment in each process), then each layer
  moves to ``cuda:LOCAL_RANK`` as it is sharded (one whole layer at a time on the GPU) and the parts kept whole
  follow, so no GPU ever holds the whole target. The CUDA path uses the same code but has not been run on GPUs.
- **limits**: a decoder with a ``layers`` list of blocks (Llama, Qwen2, Mistral, Gemma, Phi-3 style), otherwise one
  ``RetrospecError`` line.
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import RetrospecError
from ..models.loading import as_module
from .distributed import Dist


def decoder_layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """(the causal LM's decoder, its layers), or one ``RetrospecError`` line for a model without a layer list."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise RetrospecError(f"--fsdp shards a decoder's list of layers (Llama-style); this target "
                             f"({type(model).__name__}) has none")
    return decoder, list(layers)


def shard_target(target, dist: Dist, private: bool) -> nn.Module:
    """The target's module (``target``: a ``LoadedModel`` or a causal LM, frozen) with its decoder layers sharded
    over ``dist``'s processes, on ``dist.device`` (module docstring). ``private``: ``target`` is the caller's; shard
    a copy of its layers and leave it as it is. Otherwise ``target`` is this run's own: sharded in place, dropped
    from ``load_model``'s cache. Returns the module whose decoder the distillers call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = as_module(target)
    decoder, layers = decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}
    whole = [m for m in model.modules() if id(m) not in inside]  # embedding, norm, head, rotary, the wrappers
    if private:
        if any(t.device != dist.device for m in whole for t in (*m.parameters(False), *m.buffers(False))):
            raise RetrospecError(f"--fsdp with a target passed in: it must be on the training device "
                                 f"({dist.device})")
        # the copy's layers are its own; the modules outside them holding weights (not the layers' containers, which
        # the copy needs of its own) are the caller's, left whole
        holds = {id(m) for m in whole if any(id(x) in inside for x in m.modules())}
        memo = {id(m): m for m in whole if id(m) not in holds and any(True for _ in m.parameters(False))}
        model = copy.deepcopy(model, memo)
        decoder, layers = decoder_layers(model)
    else:
        from ..models import loading

        loading.forget(model)  # a later load_model in this process loads the target afresh
        for m in whole:  # a target loaded on the host for a GPU run: what is not sharded goes to the device
            m._apply(lambda t: t.to(dist.device), recurse=False)
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    sharded = {id(p) for layer in layers for p in layer.parameters()}
    kept = {p for p in decoder.parameters() if id(p) not in sharded}
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=kept)
    return model


def local_share(model: nn.Module) -> tuple[int, int]:
    """(parameter elements this process holds of ``model``'s sharded parameters, their global elements)."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    return sum(p.to_local().numel() for p in sharded), sum(p.numel() for p in sharded)
