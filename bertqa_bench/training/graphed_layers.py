"""The model's repeated layers replayed as CUDA graphs in training, forward and backward, one set
of graphs per micro-batch shape (``train.graph_layers``).

Why: the compiled BERT-base step is bound by the host. On 4 H100s 53 of its 59.8 ms are host time
and the GPU idles 24.5% (h100-scaling.md, host E's profiles); one launch per layer instead of its
kernels' launches leaves the host free to run ahead.

How: ``torch.cuda.make_graphed_callables`` over the layer stack, once per shape. It captures each
layer's forward as one graph and its backward as another, inside one autograd node per layer, so
autograd still accumulates each layer's parameter gradients when that layer's backward ends, and
DDP's all-reduce still overlaps the backward. Each layer has static inputs of its own (see
``capture``). All shapes' graphs share one memory pool. A shape's captures may reuse memory that an
earlier shape's captures freed: its intermediates and the activations saved between its forward
and its backward. That is safe because those are needed only inside one micro-step, and a
micro-step replays one shape's forward and backward to the end before any other shape's graph
runs. What stays allocated (static inputs, outputs and gradients) is never reused.

Why not ``torch.compile(mode="reduce-overhead")``: its cudagraph trees cannot replay one compiled
function called several times in a step (the layers share one compiled graph per shape). On the
H100 they overwrote a layer's saved activations before its backward read them, an error that
pytorch#170604 also reports.

Constraints: static shapes (``train.seq_bucket`` > 0; every shape is captured before the clock),
CUDA, and no module hooks on the layers. The layers take only the hidden states and the attention
mask (no cross-attention, no cache); anything else is refused with the reason.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


class LayerCall(nn.Module):
    """One layer with a tensors-only signature, ``(hidden, mask)`` or ``(hidden,)``, as
    make_graphed_callables wants it. Its parameters are the layer's, so the graphed backward
    returns their gradients."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.returned_tuple = False  # what the layer returns (transformers' versions differ)

    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.layer(hidden, mask)
        self.returned_tuple = isinstance(out, tuple)
        return out[0] if self.returned_tuple else out


def shape_key(hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple:
    """What one set of graphs serves: the hidden states' and mask's shapes and dtypes."""
    return (tuple(hidden.shape), hidden.dtype,
            None if mask is None else (tuple(mask.shape), mask.dtype))


class _Stop(Exception):
    """Raised by the input probe once the first layer's inputs are seen."""


def first_layer_inputs(model: nn.Module, first: nn.Module, run: Callable[[], object]) -> tuple:
    """The (hidden states, attention mask) the first layer receives when ``run`` runs the model:
    the embeddings and the mask exactly as the model builds them. The rest is not run."""
    seen: dict = {}

    def probe(_module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["mask"] = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        raise _Stop

    handle = first.register_forward_pre_hook(probe, with_kwargs=True)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    if "hidden" not in seen:
        raise RuntimeError(f"train.graph_layers: {type(model).__name__} never called its first layer")
    return seen["hidden"], seen["mask"]


class GraphedLayers:
    """Owns the per-shape graphs of a layer stack and routes each layer's call to them.

    ``capture(hidden, mask)`` captures all layers for that shape (a no-op when done). ``install()``
    routes the layers' calls to the graphs. The layers' parameters stay where they are, so
    checkpoints keep their names. A shape that was not captured raises, naming the shapes that
    were. ``make`` is torch.cuda.make_graphed_callables; tests pass a stand-in for CPU.
    """

    def __init__(self, layers: list[nn.Module], make: Callable = None, warmup_iters: int = 3):
        self.layers = list(layers)
        self.make = make or torch.cuda.make_graphed_callables
        self.warmup_iters = warmup_iters
        self.graphs: dict[tuple, tuple] = {}
        self.returns_tuple = False
        self.pool = None
        self.installed = False
        self.replays = 0

    def capture(self, hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
        key = shape_key(hidden, mask)
        if key in self.graphs:
            return False
        if self.installed:
            raise RuntimeError("train.graph_layers: shapes are captured before the layers are routed to the graphs")
        calls = tuple(LayerCall(layer) for layer in self.layers)
        # The sample arguments become the graphs' static inputs: each replay copies its inputs into
        # them, and a layer's backward reads what its forward saved, often that input itself. So
        # every layer gets its own hidden-state input. A shared one would hold the last layer's
        # input by the time the first layer's backward runs, and give that layer wrong weight
        # gradients. The mask is only read, and the same for every layer, so it is shared. The
        # copies are dense because a broadcast mask could not be written into.
        dense = torch.contiguous_format
        shared_mask = () if mask is None else (mask.detach().clone(memory_format=dense),)
        samples = tuple((hidden.detach().clone(memory_format=dense).requires_grad_(hidden.requires_grad),) + shared_mask
                        for _ in calls)
        kwargs = {"num_warmup_iters": self.warmup_iters}
        if self.make is torch.cuda.make_graphed_callables:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            kwargs["pool"] = self.pool
        self.graphs[key] = tuple(self.make(calls, samples, **kwargs))
        self.returns_tuple = calls[0].returned_tuple  # seen by the capture's warm-up runs
        return True

    def install(self) -> None:
        """Route every layer's call to its graph (layer i of the shape's set). The layers' own
        compiled wrappers are dropped: their kernels now live in the graphs."""
        for i, layer in enumerate(self.layers):
            layer._compiled_call_impl = None
            layer.forward = self._route(i)
        self.installed = True

    def _route(self, i: int):
        def forward(hidden_states, attention_mask=None, *args, **kwargs):
            extra = [f"positional #{n + 3}" for n, a in enumerate(args) if a is not None] + \
                [k for k, v in kwargs.items() if v is not None and v is not False]
            if extra:
                raise RuntimeError(f"train.graph_layers: layer {i} was called with more than hidden states and a "
                                   f"mask ({', '.join(extra)}); the graphs take only those two")
            if not self.layers[i].training:
                raise RuntimeError("train.graph_layers: the graphs were captured in training mode and serve training "
                                   "only; evaluate from the saved checkpoint")
            graphs = self.graphs.get(shape_key(hidden_states, attention_mask))
            if graphs is None:
                raise RuntimeError(f"train.graph_layers: no graphs for hidden states {tuple(hidden_states.shape)} "
                                   f"with {'no mask' if attention_mask is None else 'a mask'}; captured: "
                                   f"{sorted(str(k[0]) + (' masked' if k[2] else '') for k in self.graphs)}")
            self.replays += i == 0
            out = graphs[i](hidden_states) if attention_mask is None else graphs[i](hidden_states, attention_mask)
            return (out,) if self.returns_tuple else out

        return forward

    def uninstall(self) -> None:
        """Give the layers their own forward back and drop the graphs, their pool and static
        tensors (the routed forwards and this object reference each other, so without this they
        would live until a cyclic collection)."""
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        self.graphs.clear()
        self.pool = None
        self.installed = False

    def info(self) -> dict:
        return {"graphed_layers": len(self.layers), "graphed_shapes": len(self.graphs),
                "cuda_graphs": 2 * len(self.layers) * len(self.graphs)}
