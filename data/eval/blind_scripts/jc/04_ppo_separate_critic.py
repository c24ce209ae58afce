# PPO with a separate critic (value model initialised from the reward model).
#
#   torchrun --nproc_per_node=4 04_ppo_separate_critic.py \
#       --policy_path ckpt/sft-pythia-1b --reward_path ckpt/rm-pythia-1b --dataset data/tldr_prompts.jsonl
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
)


@dataclass
class PPOConfig:
    policy_path: str = field(default="ckpt/sft")
    reward_path: str = field(default="ckpt/rm")
    dataset: str = field(default="data/tldr_prompts.jsonl")
    output_dir: str = field(default="ckpt/ppo_critic")
    local_rollout: int = 64
    minibatches: int = 4
    ppo_epochs: int = 4
    total_episodes: int = 1_000_000
    response_length: int = 53
    temperature: float = 0.7
    policy_lr: float = 3e-6
    critic_lr: float = 3e-6
    kl_coef: float = 0.05
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    missing_eos_penalty: float = 1.0
    seed: int = 1


def load_prompts(path):
    with open(path) as f:
        return [json.loads(l)["query"] for l in f]


def first_true_indices(bools):
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).long() + torch.arange(row_len, device=bools.device)
    return zero_or_index.min(-1).values


def token_logprobs(logits, tokens, temperature):
    logits = logits / (temperature + 1e-7)
    return torch.gather(F.log_softmax(logits.float(), -1), 2, tokens.unsqueeze(-1)).squeeze(-1)


class Critic(nn.Module):
    """Per-token value model: reward model trunk + its score head applied at every position."""

    def __init__(self, path):
        super().__init__()
        rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        self.config = rm.config
        self.trunk = rm.base_model
        self.score = rm.score

    def forward(self, input_ids, attention_mask):
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.score(h).squeeze(-1)


def seq_score(rm, seq, attn, pad_id, ctx_len):
    h = rm.base_model(input_ids=seq, attention_mask=attn).last_hidden_state
    logits = rm.score(h).squeeze(-1)
    last = first_true_indices(seq[:, ctx_len:] == pad_id) - 1 + ctx_len
    return logits[torch.arange(seq.size(0), device=seq.device), last]


def main():
    (cfg,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.policy_path, padding_side="left")
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "[PAD]"})
    pad_id = tok.pad_token_id

    policy = AutoModelForCausalLM.from_pretrained(cfg.policy_path).to(dev)
    ref_policy = AutoModelForCausalLM.from_pretrained(cfg.policy_path).to(dev).eval()
    critic = Critic(cfg.reward_path).to(dev)
    reward_model = AutoModelForSequenceClassification.from_pretrained(cfg.reward_path, num_labels=1).to(dev).eval()
    for m in (ref_policy, reward_model):
        m.requires_grad_(False)
    for m in (policy, ref_policy, critic.trunk, reward_model):
        if m.get_input_embeddings().num_embeddings < len(tok):
            m.resize_token_embeddings(len(tok))

    policy = DDP(policy, device_ids=[local_rank])
    critic = DDP(critic, device_ids=[local_rank])
    pol_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.policy_lr, eps=1e-5)
    cri_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, eps=1e-5)

    prompts = load_prompts(cfg.dataset)
    sampler = DistributedSampler(prompts, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(prompts, batch_size=cfg.local_rollout, sampler=sampler, drop_last=True)
    num_updates = cfg.total_episodes // (cfg.local_rollout * world)
    mb = cfg.local_rollout // cfg.minibatches
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        print(f"world={world} updates={num_updates} rollout/rank={cfg.local_rollout} minibatch={mb}")

    def lr_lambda(u):
        return 1.0 - u / num_updates

    pol_sched = torch.optim.lr_scheduler.LambdaLR(pol_opt, lr_lambda)
    cri_sched = torch.optim.lr_scheduler.LambdaLR(cri_opt, lr_lambda)

    update, epoch = 0, 0
    start = time.time()
    while update < num_updates:
        sampler.set_epoch(epoch)
        epoch += 1
        for batch_prompts in loader:
            if update >= num_updates:
                break
            update += 1
            q = tok(list(batch_prompts), return_tensors="pt", padding=True, truncation=True, max_length=512).to(dev)
            ctx_len = q.input_ids.shape[1]

            with torch.no_grad():
                policy.eval()
                seq = policy.generate(
                    input_ids=q.input_ids,
                    attention_mask=q.attention_mask,
                    max_new_tokens=cfg.response_length,
                    min_new_tokens=cfg.response_length,
                    do_sample=True,
                    temperature=cfg.temperature,
                    top_k=0,
                    pad_token_id=pad_id,
                )
                policy.train()
                resp = seq[:, ctx_len:]
                # everything after the first EOS becomes padding
                eos_at = first_true_indices(resp == tok.eos_token_id)
                idx = torch.arange(resp.shape[1], device=dev).unsqueeze(0)
                resp = torch.where(idx > eos_at.unsqueeze(1), torch.full_like(resp, pad_id), resp)
                seq = torch.cat([q.input_ids, resp], 1)
                attn = (seq != pad_id).long()
                pad_mask = idx > eos_at.unsqueeze(1)

                logits = policy.module(input_ids=seq, attention_mask=attn).logits[:, ctx_len - 1:-1]
                logp = token_logprobs(logits, resp, cfg.temperature)
                ref_logits = ref_policy(input_ids=seq, attention_mask=attn).logits[:, ctx_len - 1:-1]
                ref_logp = token_logprobs(ref_logits, resp, cfg.temperature)
                values = critic.module(seq, attn)[:, ctx_len - 1:-1]
                scores = seq_score(reward_model, seq, attn, pad_id, ctx_len)
                contains_eos = (resp == tok.eos_token_id).any(-1)
                scores = torch.where(contains_eos, scores, scores - cfg.missing_eos_penalty)

                logp = logp.masked_fill(pad_mask, 1.0)
                ref_logp = ref_logp.masked_fill(pad_mask, 1.0)
                values = values.masked_fill(pad_mask, 0.0)
                kl = logp - ref_logp
                rewards = -cfg.kl_coef * kl
                last = (eos_at.clamp(max=resp.shape[1] - 1))
                rewards[torch.arange(resp.shape[0], device=dev), last] += scores

                adv = torch.zeros_like(rewards)
                gae = torch.zeros(resp.shape[0], device=dev)
                for t in reversed(range(resp.shape[1])):
                    nv = values[:, t + 1] if t + 1 < resp.shape[1] else 0.0
                    delta = rewards[:, t] + cfg.gamma * nv - values[:, t]
                    gae = delta + cfg.gamma * cfg.lam * gae
                    adv[:, t] = gae
                returns = adv + values
                valid = (~pad_mask).float()
                mean = (adv * valid).sum() / valid.sum()
                var = (((adv - mean) ** 2) * valid).sum() / valid.sum()
                adv = ((adv - mean) * torch.rsqrt(var + 1e-8)).masked_fill(pad_mask, 0.0)

            for _ in range(cfg.ppo_epochs):
                order = torch.randperm(cfg.local_rollout, device=dev)
                for s in range(0, cfg.local_rollout, mb):
                    i = order[s:s + mb]
                    v = valid[i]
                    new_logits = policy(input_ids=seq[i], attention_mask=attn[i]).logits[:, ctx_len - 1:-1]
                    new_logp = token_logprobs(new_logits, resp[i], cfg.temperature)
                    ratio = torch.exp(new_logp - logp[i])
                    pg1 = -adv[i] * ratio
                    pg2 = -adv[i] * ratio.clamp(1 - cfg.cliprange, 1 + cfg.cliprange)
                    pg_loss = (torch.max(pg1, pg2) * v).sum() / v.sum()
                    pol_opt.zero_grad(set_to_none=True)
                    pg_loss.backward()
                    nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                    pol_opt.step()

                    vpred = critic(seq[i], attn[i])[:, ctx_len - 1:-1]
                    vclip = values[i] + (vpred - values[i]).clamp(-cfg.cliprange_value, cfg.cliprange_value)
                    vf = torch.max((vpred - returns[i]) ** 2, (vclip - returns[i]) ** 2)
                    vf_loss = 0.5 * (vf * v).sum() / v.sum()
                    cri_opt.zero_grad(set_to_none=True)
                    vf_loss.backward()
                    nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                    cri_opt.step()
            pol_sched.step()
            cri_sched.step()

            with torch.no_grad():
                stats = torch.stack([
                    (kl * valid).sum(1).mean(),
                    scores.mean(),
                    contains_eos.float().mean(),
                    pg_loss.detach(),
                    vf_loss.detach(),
                ])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0 and update % 10 == 0:
                print(f"update {update}/{num_updates} kl {stats[0]:.3f} score {stats[1]:.3f} "
                      f"eos {stats[2]:.2f} pg {stats[3]:.4f} vf {stats[4]:.4f} "
                      f"eps/s {update * cfg.local_rollout * world / (time.time() - start):.1f}", flush=True)
            if rank == 0 and update % 200 == 0:
                policy.module.save_pretrained(os.path.join(cfg.output_dir, f"step_{update}"))
                tok.save_pretrained(os.path.join(cfg.output_dir, f"step_{update}"))

    if rank == 0:
        policy.module.save_pretrained(cfg.output_dir)
        tok.save_pretrained(cfg.output_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
