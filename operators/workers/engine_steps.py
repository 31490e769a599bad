"""The DeepSpeed engine's side of a train step: the LM head gathered once per micro-batch under ZeRO-3, the
optimizer steps (gradient accumulation over micro-batches) and their gradient norms, and the NaN protocol
(every rank agrees that a loss is finite before its backward; the gradients of an optimizer step that will
not be taken are dropped; a job told to stop gets a NonFiniteError).

Plumbing only: operators/workers/train_worker.py decides when each is called.
"""

from __future__ import annotations

import contextlib


class NonFiniteError(RuntimeError):
    """The loss or the weights became NaN/inf and the job must stop (nothing was published)."""


def gathered_head(deepspeed, head, zero_stage: int):
    """A context in which the LM head's parameters are whole: under ZeRO-3 they are gathered when it is
    entered and partitioned again when it exits (deepspeed.zero.GatheredParameters); otherwise nothing.

    The trainer holds it from the chunked log-probs of a micro-batch until that micro-batch's backward is
    done: every chunk, every recompute of a chunk in backward and the head's gradient use the one gather
    (a gradient reaches a ZeRO-3 parameter only while it is whole; DeepSpeed reduces it to the shards as
    it arrives). Calling the head module per chunk instead gathers it per chunk and per recompute."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters([p for p in head.parameters()])


def finite_everywhere(torch, loss, device, world_size: int) -> bool:
    """True when the loss is finite on every rank (all ranks must agree to skip a step together)."""
    finite = torch.tensor([float(bool(torch.isfinite(loss.detach()).all()))], device=device)
    if world_size > 1:
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return bool(finite.item())


def max_over_ranks(torch, value: int, device) -> int:
    """The largest of every rank's `value` (a collective: every rank calls it)."""
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def optimizer_steps(torch, engine, mini_batches, loss_of, stop_message, release, *, zero_stage: int,
                    nan_policy: str, device, world_size: int, who: str) -> tuple[list[float], list[float], bool, int]:
    """Take one optimizer step per mini-batch. `mini_batches` yields (indices, tokens, sequences, epoch,
    valid_sequences) per optimizer step, in order (the same on every rank);
    `loss_of(indices, tokens, sequences, epoch, valid_sequences)` yields (loss, last) per micro-batch (the
    same number on every rank); each gets its own backward, the gradients accumulate, and the last backward
    is the accumulation boundary before the optimizer step. `release()` runs after each backward.

    Before each backward the ranks agree that the loss is finite. One that is not, on any rank, ends
    the step: the gradients accumulated for this optimizer step are dropped (the optimizer steps
    already taken stay applied), or it raises with `stop_message(value)` under nan_policy "stop"
    (`who` names the rank). Returns the losses, the gradient norms, whether the step was cut short and
    the number of passes."""
    losses, grad_norms, passes = [], [], 0
    for indices, tokens, sequences, epoch, valid in mini_batches:
        total, accumulated = 0.0, 0
        for loss, last in loss_of(indices, tokens, sequences, epoch, valid):
            passes += 1
            # the NaN protocol: every rank agrees, or the step ends here
            if not finite_everywhere(torch, loss, device, world_size):
                losses.append(loss.item())
                if accumulated:
                    discard_gradients(torch, engine, loss, zero_stage, who)
                if nan_policy == "stop":
                    raise NonFiniteError(stop_message(losses[-1]))
                return losses, grad_norms, True, passes
            # gradient accumulation over micro-batches, one backward each
            accumulated += 1
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss)
            total += loss.item()
            del loss
            release()
        losses.append(total)
        grad_norms.append(optimizer_step(torch, engine, zero_stage))  # clip and step
    return losses, grad_norms, False, passes


def optimizer_step(torch, engine, zero_stage: int) -> float:
    """One DeepSpeed optimizer step on the accumulated gradients (the last backward was the
    accumulation boundary); the global gradient norm before clipping."""
    own_norm = plain_grad_norm(torch, engine.module) if zero_stage == 0 else None
    engine.step()
    grad_norm = engine.get_global_grad_norm() if own_norm is None else own_norm
    return float(grad_norm) if grad_norm is not None else float("nan")


def plain_grad_norm(torch, module) -> float:
    """Global gradient norm before clipping. Without ZeRO, DeepSpeed does not report it;
    gradients are already averaged over ranks after backward, so this is the global one."""
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def discard_gradients(torch, engine, loss, zero_stage: int, who: str) -> None:
    """Drop the gradients accumulated for an optimizer step that will not be taken, because the
    micro-batch `loss` (non-finite on some rank) came after others were backwarded. Every rank calls it;
    `who` names the rank in the error (e.g. "policy rank 0").

    Without ZeRO the module's gradients are all there is: the engine's zero_grad drops them. ZeRO keeps
    reduced gradient partitions of its own, with no public call to drop them, so this uses DeepSpeed's
    own skip: every rank backwards the non-finite loss (NaN where it is finite) as the accumulation
    boundary, and DeepSpeed's step finds a non-finite gradient norm, skips the update, clears its
    gradients and leaves the LR schedule where it was (ZeRO 1-2 in fp32 and ZeRO 3 always; ZeRO 1-2
    in bf16 with `bf16.check_grad_overflow`, which the config sets)."""
    if not zero_stage:
        engine.zero_grad()
        return
    poisoned = loss * float("nan") if bool(torch.isfinite(loss.detach())) else loss
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(poisoned)
    engine.step()
    if getattr(engine.optimizer, "overflow", False) is not True:  # DeepSpeed changed: never train on it
        raise NonFiniteError(
            f"{who}: DeepSpeed did not skip an optimizer step with a non-finite gradient "
            f"(ZeRO {zero_stage}); the weights may be damaged. Resume from the last checkpoint"
        )
