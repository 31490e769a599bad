"""The trainer's step written out in plain torch (no DeepSpeed, no TrainWorker code): what the trainer tests
(tests/integration/test_trainer.py, test_lora.py) compare a TrainWorker's step with."""

from __future__ import annotations

import numpy as np


def reference_updates(model_path: str, samples: dict, cfg, partitions: list[list[list[int]]], adapt=None):
    """The same train step written out in plain torch (no DeepSpeed, no TrainWorker code): per optimizer
    step, forward the mini-batch, the policy loss with TIS (token: weight min(rho_t, C); sequence: min(prod
    rho, C) in place of rho_t), KL to the reference and the entropy bonus, token_mean over the mini-batch's
    trained tokens (or Dr. GRPO's sum over responses with a trained token x max_new_tokens), backward, clip,
    AdamW. Multi-turn samples (`loss_masks`) train their policy tokens only. pi_prox is computed before the
    first update when there are several, else it is the current log-probs. Returns (losses, grad norms,
    weights).

    `adapt(model)`: the model to train in place of the pretrained one (with LoRA adapters: tests/integration/
    test_lora.py); only its parameters that require gradients are optimised, and the weights returned are
    `adapt.weights(model)` when it has that attribute (the merged ones), else the state dict."""
    import torch
    from transformers import AutoModelForCausalLM

    from operators.algorithms.losses import KL_ESTIMATORS, POLICY_LOSSES

    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    if adapt is not None:
        model = adapt(model)
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=cfg.train.weight_decay)
    algo = cfg.algorithm

    def tensors(indices):
        seqs = [[*samples["prompt_token_ids"][i], *samples["response_token_ids"][i]] for i in indices]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), model.config.pad_token_id or 0)
        attention = torch.zeros_like(ids)
        per_token = {key: torch.zeros(len(seqs), width - 1) for key in ("mask", "behave", "adv", "ref")}
        for row, (i, seq) in enumerate(zip(indices, seqs)):
            ids[row, :len(seq)], attention[row, :len(seq)] = torch.tensor(seq), 1
            at = slice(len(samples["prompt_token_ids"][i]) - 1, len(seq) - 1)  # next-token positions
            per_token["mask"][row, at] = torch.tensor([float(m) for m in samples["loss_masks"][i]]) \
                if "loss_masks" in samples else 1.0
            per_token["behave"][row, at] = torch.tensor(samples["behavior_logprobs"][i])
            per_token["adv"][row, at] = samples["advantages"][i]
            per_token["ref"][row, at] = torch.tensor(samples["ref_logprobs"][i])
        return ids, attention, per_token

    def logits_logprobs(ids, attention):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / cfg.rollout.temperature
        return logits, torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    updates = cfg.train.ppo_epochs * cfg.train.mini_batches
    everyone = list(range(len(samples["advantages"])))
    if updates > 1:
        with torch.no_grad():
            ids, attention, _ = tensors(everyone)
            prox_all = logits_logprobs(ids, attention)[1]  # [N, L-1]
    losses, norms = [], []
    for epoch_parts in partitions:
        for indices in epoch_parts:
            ids, attention, t = tensors(indices)
            logits, logprobs = logits_logprobs(ids, attention)
            prox = prox_all[indices][:, :logprobs.shape[1]] if updates > 1 else logprobs.detach()
            options = dict(clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high)
            if algo.policy_loss == "decoupled_ppo":
                options.update(proximal_logprobs=prox, clip_ratio_c=algo.clip_ratio_c)
            per_token, _ = POLICY_LOSSES.get(algo.policy_loss)(logprobs, t["behave"], t["adv"], t["mask"], **options)
            log_rho = (prox - t["behave"]) * t["mask"]
            if algo.tis == "token":  # effective behaviour weight min(rho, cap)
                per_token = per_token * torch.clamp(algo.tis_cap / torch.exp(log_rho), max=1.0)
            if algo.tis == "sequence":  # the response's prod rho, capped, in place of each token's rho
                capped = torch.clamp(log_rho.sum(-1, keepdim=True), max=float(np.log(algo.tis_cap)))
                per_token = per_token * torch.exp(capped - log_rho)
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            per_token = per_token - algo.entropy_coef * entropy
            per_token = per_token + algo.kl_coef * KL_ESTIMATORS.get(algo.kl_estimator)(logprobs, t["ref"])
            if algo.loss_aggregation == "seq_mean_token_sum_norm":
                responses = float((t["mask"].sum(-1) > 0).sum())
                loss = (per_token * t["mask"]).sum() / (responses * cfg.rollout.max_new_tokens)
            else:
                loss = (per_token * t["mask"]).sum() / t["mask"].sum()
            optimizer.zero_grad()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(trained, cfg.train.grad_clip)))
            optimizer.step()
            losses.append(loss.item())
    if adapt is not None and hasattr(adapt, "weights"):
        return losses, norms, adapt.weights(model)
    return losses, norms, {k: v.detach().numpy() for k, v in model.state_dict().items()}
