"""Optimizers that read each parameter as one matrix, met with the routed experts' LoRA, which is stacked per expert
([E, r, in] and [E, out, r]: E matrices in one parameter). Checked at an optimizer's first step (trainers build
their optimizer where kt_sft cannot see it: LLaMA-Factory's `use_adam_mini`, `use_muon`):

- Adam-mini splits a parameter into blocks by its name and first dimension, and failed on the stacked LoRA at its
  first step with a reshape error deep in its code: refused in one sentence instead.
- LLaMA-Factory's Muon orthogonalizes the 2-D parameters and gives the rest its AdamW part, so the experts' LoRA
  trained with AdamW beside an attention LoRA trained with Muon, without a word: warned.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._ext import warn

_checked: weakref.WeakSet = weakref.WeakSet()
_installed: list = []


def check_optimizers_against(stacked_lora: Callable[[], Iterable[torch.Tensor]]) -> None:
    """Installs (once per process) the check of each optimizer's first step against the parameters that
    stacked_lora() gives at that step."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(lambda optimizer, *_: _check(optimizer, stacked_lora)))


def _check(optimizer, stacked_lora) -> None:
    kind = type(optimizer).__name__
    if optimizer in _checked or kind not in ("Adam_mini", "Muon"):
        return
    stacked = {id(p) for p in stacked_lora()}
    params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in stacked]
    if kind == "Adam_mini" and params:  # at every step: a retry would reach adam_mini's own error
        raise ValueError("Adam-mini (LLaMA-Factory's use_adam_mini) splits each parameter into blocks as one matrix "
                         "and cannot take the routed experts' LoRA, which stacks one matrix per expert; leave "
                         "`experts` out of lora_target, or use another optimizer.")
    _checked.add(optimizer)
    if any(not optimizer.state[p].get("use_muon", True) for p in params):
        warn("kt_sft: Muon (LLaMA-Factory's use_muon) orthogonalizes 2-D parameters only, so the routed experts' LoRA, "
             "which stacks one matrix per expert, trains with Muon's AdamW part (the other LoRA matrices with Muon); "
             "leave `experts` out of lora_target to keep every LoRA matrix on Muon.")
