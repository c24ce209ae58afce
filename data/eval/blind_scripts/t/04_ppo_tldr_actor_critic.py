"""
PPO-RLHF on TL;DR summarization with a shared-trunk actor-critic (Pythia SFT
checkpoint + scalar value head), a frozen reference policy and a frozen
reward model. Rollouts with HF generate(), GAE, clipped policy/value losses.

    torchrun --standalone --nproc_per_node=4 04_ppo_tldr_actor_critic.py \
        --sft_model cleanrl/EleutherAI_pythia-410m-deduped__sft__tldr \
        --reward_model cleanrl/EleutherAI_pythia-410m-deduped__reward__tldr
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--sft_model", default="cleanrl/EleutherAI_pythia-410m-deduped__sft__tldr")
    p.add_argument("--reward_model", default="cleanrl/EleutherAI_pythia-410m-deduped__reward__tldr")
    p.add_argument("--output_dir", default="runs/ppo_tldr")
    p.add_argument("--rollout_batch", type=int, default=32)
    p.add_argument("--mini_batch", type=int, default=8)
    p.add_argument("--ppo_epochs", type=int, default=4)
    p.add_argument("--critic_warmup", type=int, default=10, help="rollouts that only train the value head")
    p.add_argument("--total_rollouts", type=int, default=1000)
    p.add_argument("--max_new_tokens", type=int, default=53)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf_clip", type=float, default=0.2)
    p.add_argument("--vf_coef", type=float, default=0.1)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class ActorCritic(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(name)
        hidden = self.lm.config.hidden_size
        self.v_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.v_head.weight, std=1 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids, attention_mask, value_only=False):
        if value_only:
            h = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return None, self.v_head(h).squeeze(-1)
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1]).squeeze(-1)


def gather_logp(logits, tokens):
    return torch.gather(F.log_softmax(logits.float(), -1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp(min=1)


def whiten(x, m):
    mu = masked_mean(x, m)
    var = masked_mean((x - mu) ** 2, m)
    return (x - mu) * torch.rsqrt(var + 1e-8)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.sft_model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = ActorCritic(args.sft_model).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.sft_model).to(dev).eval().requires_grad_(False)
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model, num_labels=1).to(dev)
    rm.eval().requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)

    ds = load_dataset("trl-internal-testing/tldr-preference-sft-trl-style", split="train")
    ds = ds.filter(lambda ex: len(ex["prompt"]) < 2000)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.rollout_batch, sampler=sampler, collate_fn=lambda b: [x["prompt"] for x in b])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-5)

    it, epoch = iter(loader), 0
    sampler.set_epoch(epoch)
    for update in range(args.total_rollouts):
        t0 = time.time()
        try:
            prompts = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            prompts = next(it)

        enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=512).to(dev)
        P = enc.input_ids.shape[1]

        # ---------------- rollout ----------------
        model.eval()
        with torch.no_grad():
            seq = model.module.lm.generate(**enc, do_sample=True, top_k=0, top_p=1.0, temperature=0.7,
                                           max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
            resp = seq[:, P:]
            attn = torch.cat([enc.attention_mask, torch.ones_like(resp)], 1)
            resp_mask = torch.ones_like(resp, dtype=torch.float)
            ended = (resp == tok.eos_token_id).cumsum(1) > 0
            after_eos = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], 1)
            resp_mask[after_eos] = 0.0

            logits, values = model(seq, attn)
            old_logp = gather_logp(logits[:, P - 1:-1], resp)
            old_values = values[:, P - 1:-1]
            ref_logp = gather_logp(ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)
            score = rm(input_ids=seq, attention_mask=attn).logits.squeeze(-1)
            # summaries that never emit EOS get a fixed penalty
            score = torch.where(ended.any(1), score, torch.full_like(score, -1.0))

            kl = old_logp - ref_logp
            rewards = -args.kl_coef * kl * resp_mask
            last = (resp_mask.sum(1) - 1).long()
            rewards[torch.arange(len(last), device=dev), last] += score

            adv = torch.zeros_like(rewards)
            lastgaelam = torch.zeros(rewards.shape[0], device=dev)
            T = rewards.shape[1]
            for t in reversed(range(T)):
                nv = old_values[:, t + 1] if t + 1 < T else torch.zeros_like(lastgaelam)
                delta = rewards[:, t] + args.gamma * nv * resp_mask[:, t] - old_values[:, t]
                lastgaelam = delta + args.gamma * args.lam * lastgaelam
                adv[:, t] = lastgaelam
            returns = adv + old_values
            adv = whiten(adv, resp_mask)

        # ---------------- optimisation ----------------
        model.train()
        critic_only = update < args.critic_warmup
        stats = torch.zeros(4, device=dev)
        n = 0
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(seq.shape[0], device=dev)
            for i in range(0, seq.shape[0], args.mini_batch):
                idx = perm[i:i + args.mini_batch]
                mb_mask = resp_mask[idx]
                if critic_only:
                    _, v = model(seq[idx], attn[idx], value_only=True)
                    pg_loss = torch.zeros((), device=dev)
                    approx_kl = torch.zeros((), device=dev)
                else:
                    lg, v = model(seq[idx], attn[idx])
                    logp = gather_logp(lg[:, P - 1:-1], resp[idx])
                    ratio = torch.exp(logp - old_logp[idx])
                    pg1 = -adv[idx] * ratio
                    pg2 = -adv[idx] * torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                    pg_loss = masked_mean(torch.max(pg1, pg2), mb_mask)
                    approx_kl = masked_mean(0.5 * (logp - old_logp[idx]) ** 2, mb_mask).detach()
                v = v[:, P - 1:-1]
                v_clip = old_values[idx] + torch.clamp(v - old_values[idx], -args.vf_clip, args.vf_clip)
                vf_loss = 0.5 * masked_mean(torch.max((v - returns[idx]) ** 2, (v_clip - returns[idx]) ** 2), mb_mask)
                loss = pg_loss + args.vf_coef * vf_loss

                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                stats += torch.stack([pg_loss.detach(), vf_loss.detach(), approx_kl, torch.ones((), device=dev)])
                n += 1

        mean_score = score.mean().detach()
        mean_kl = (kl * resp_mask).sum(1).mean()
        summary = torch.cat([stats[:3] / stats[3], mean_score.view(1), mean_kl.view(1)])
        dist.all_reduce(summary, op=dist.ReduceOp.AVG)
        if rank == 0:
            pg, vf, akl, sc, klv = summary.tolist()
            print(f"update {update} {'critic-warmup ' if critic_only else ''}score {sc:.3f} kl {klv:.3f} "
                  f"pg {pg:.4f} vf {vf:.4f} approx_kl {akl:.5f} ({time.time() - t0:.1f}s)", flush=True)

        if rank == 0 and (update + 1) % 100 == 0:
            out = os.path.join(args.output_dir, f"update_{update + 1}")
            model.module.lm.save_pretrained(out)
            tok.save_pretrained(out)
            torch.save(model.module.v_head.state_dict(), os.path.join(out, "v_head.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
