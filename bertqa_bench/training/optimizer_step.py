"""The optimizer phase of a training step (clip, AdamW, zero the gradients), eager or as one
CUDA graph.

On a GPU that the host cannot keep busy (the compiled BERT-base step at 128 rows per GPU idles
~25%, h100-scaling.md), the optimizer phase is ~4 ms of host time per step: gradient clipping,
the fused AdamW launch and zeroing, each a handful of launches over 200 parameter tensors. Data
parallel training pays it at every micro-step on 4 GPUs but once per 4 micro-steps on one, so it
is a fixed cost that does not shrink with N. Captured as one CUDA graph it is one launch.

What capture needs, and why each holds here:
- the gradients keep their addresses: they are zeroed in place, never set to None (so the first
  micro-step adds into zeros instead of taking the new gradient: one more elementwise pass);
- the optimizer's state lives on the device and its step counter too: AdamW(fused, capturable);
- the learning rate is a device tensor the scheduler fills in place each step (torch's LR
  schedulers do so for tensor learning rates), so the graph reads the current one;
- no host sync inside: clipping on the device (foreach, no error_if_nonfinite), and no GradScaler
  (FP16's unscale/skip decision is a host sync), so BF16 or FP32 only.
The first two steps run eagerly (the first creates AdamW's state; DDP rebuilds its gradient
buckets once, in the second), the third is captured and replayed, and every replay checks that the
gradients are still the tensors the graph was captured on.
"""
from __future__ import annotations

import torch


def make_adamw(model: torch.nn.Module, lr: float, weight_decay: float, *, fused: bool = False,
               capturable: bool = False) -> torch.optim.AdamW:
    """AdamW with no decay on biases and LayerNorm weights (BERT's original recipe). fused: one
    kernel for the whole update (CUDA), one vectorized pass over each parameter (CPU). capturable: state and learning rate on the device, for
    CUDA-graph capture (the learning rate becomes a float32 device tensor per group)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in n or n.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if not capturable:
        return torch.optim.AdamW(groups, lr=lr, fused=fused or None)
    device = decay[0].device
    for g in groups:  # one tensor per group: the scheduler fills each in place
        g["lr"] = torch.tensor(float(lr), device=device)
    return torch.optim.AdamW(groups, lr=lr, fused=True, capturable=True)


class EagerOptimizerStep:
    """clip, step, zero: the step as it always ran. The gradients are set to None, or zeroed in
    place with ``zero_to_none=False`` (the layers' backward replayed as CUDA graphs writes into
    graph memory, which must never become a ``.grad``)."""

    kind = "eager"

    def __init__(self, params, optimizer: torch.optim.Optimizer, max_norm: float, scaler=None,
                 zero_to_none: bool = True):
        self.params, self.optimizer, self.max_norm, self.scaler = list(params), optimizer, max_norm, scaler
        self.zero_to_none = zero_to_none

    def __call__(self) -> None:
        if self.scaler is not None and self.scaler.is_enabled():  # FP16: unscale (device-side inf check), step or skip
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.zero_to_none)


class GraphedOptimizerStep:
    """clip, step, zero in place, as one CUDA graph from the third call on (see the module doc)."""

    kind = "cuda-graph"

    def __init__(self, params, optimizer: torch.optim.Optimizer, max_norm: float):
        self.params, self.optimizer, self.max_norm = list(params), optimizer, max_norm
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self._lrs = [g["lr"] for g in optimizer.param_groups]

    def check_schedule(self) -> None:
        """The scheduler must fill the learning-rate tensors in place: a replaced tensor would
        leave the graph reading a stale rate. Checked at every call (the scheduler steps between)."""
        if any(g["lr"] is not t for g, t in zip(self.optimizer.param_groups, self._lrs)):
            raise RuntimeError("train.graph_optimizer_step: the LR scheduler replaced the learning-rate tensor "
                               "instead of filling it in place (this torch's schedulers do not support tensor "
                               "learning rates); set train.graph_optimizer_step=false")

    def _step(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.optimizer.step()
        torch._foreach_zero_(grads)

    def _grad_ptrs(self) -> list:
        return [None if p.grad is None else p.grad.data_ptr() for p in self.params]

    def __call__(self) -> None:
        self.calls += 1
        self.check_schedule()
        if self.graph is not None:
            if self._grad_ptrs() != self._captured:
                raise RuntimeError("train.graph_optimizer_step: a gradient was replaced after capture (the graph "
                                   "would update stale memory); set train.graph_optimizer_step=false")
            self.graph.replay()
            return
        if self.calls < self.EAGER_CALLS:
            self._step()
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records only; synchronizes before capture
            self._step()
        graph.replay()
        self.graph, self._captured = graph, self._grad_ptrs()

    EAGER_CALLS = 3  # captured at this call


def optimizer_step(params, optimizer, max_norm: float, *, graphed: bool, scaler=None, zero_to_none: bool = True):
    """The step the trainer calls once per optimizer step (the graphed one always zeroes in place)."""
    return GraphedOptimizerStep(params, optimizer, max_norm) if graphed else \
        EagerOptimizerStep(params, optimizer, max_norm, scaler, zero_to_none=zero_to_none)
