"""PPO for RLHF on a GPT-2 policy: policy and critic each under DDP, frozen
reference policy and frozen reward model on every rank.

torchrun --nproc_per_node=8 ppo_gpt2.py --policy ckpts/gpt2-medium-sft --reward_model ckpts/gpt2-rm \
    --prompts data/tldr_prompts_train.jsonl --eval_prompts data/tldr_prompts_val.jsonl
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--reward_model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--eval_prompts", required=True)
    p.add_argument("--out", default="ckpts/ppo")
    p.add_argument("--rollout_bs", type=int, default=32, help="prompts per GPU per PPO iteration")
    p.add_argument("--mini_bs", type=int, default=8)
    p.add_argument("--ppo_epochs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--max_new", type=int, default=53)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--critic_lr", type=float, default=5e-6)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf_clip", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--wandb_project", default="ppo-tldr")
    p.add_argument("--run_name", default=None)
    return p.parse_args()


class Prompts(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l)["prompt"] for l in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Critic(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.body = AutoModel.from_pretrained(name)
        self.v_head = nn.Linear(self.body.config.hidden_size, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.v_head(h).squeeze(-1)


def token_logprobs(model, seq, mask):
    logits = model(input_ids=seq, attention_mask=mask).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, seq[:, 1:].unsqueeze(-1)).squeeze(-1)


def right_align_for_rm(seq, mask):
    # prompts are left padded for generation; the RM head reads the last non-pad token of a right-padded row
    out_s, out_m = torch.zeros_like(seq), torch.zeros_like(mask)
    for i in range(seq.size(0)):
        n = int(mask[i].sum())
        idx = mask[i].nonzero().squeeze(-1)
        out_s[i, :n], out_m[i, :n] = seq[i, idx], 1
    return out_s, out_m


@torch.no_grad()
def rollout(policy, ref, critic, rm, tok, prompts, args, device):
    enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=512).to(device)
    P = enc.input_ids.size(1)
    seq = policy.module.generate(**enc, max_new_tokens=args.max_new, do_sample=True, top_k=0, top_p=1.0,
                                 pad_token_id=tok.pad_token_id)
    resp = seq[:, P:]
    # response mask: everything up to and including the first eos
    is_eos = resp == tok.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], resp.size(1) - 1, dtype=torch.long))
    resp_mask = (torch.arange(resp.size(1), device=device)[None] <= first_eos[:, None]).long()
    mask = torch.cat([enc.attention_mask, resp_mask], 1)

    logp = token_logprobs(policy.module, seq, mask)[:, P - 1:]
    ref_logp = token_logprobs(ref, seq, mask)[:, P - 1:]
    values = critic.module(seq, mask)[:, P - 1:-1]
    rs, rmask = right_align_for_rm(seq, mask)
    score = rm(input_ids=rs, attention_mask=rmask).logits.squeeze(-1).float()

    kl = logp - ref_logp
    rewards = -args.kl_coef * kl * resp_mask
    rewards[torch.arange(seq.size(0)), first_eos] += score
    adv = torch.zeros_like(rewards)
    last = torch.zeros(seq.size(0), device=device)
    for t in reversed(range(rewards.size(1))):
        nv = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros_like(last)
        delta = rewards[:, t] + args.gamma * nv * resp_mask[:, t] - values[:, t]
        last = delta + args.gamma * args.lam * last
        adv[:, t] = last
    adv = adv * resp_mask
    returns = adv + values
    mean = (adv.sum() / resp_mask.sum())
    std = (((adv - mean) ** 2 * resp_mask).sum() / resp_mask.sum()).sqrt()
    adv = (adv - mean) / (std + 1e-8) * resp_mask
    return dict(seq=seq, mask=mask, resp_mask=resp_mask.float(), logp=logp, values=values, adv=adv,
                returns=returns, score=score, kl=(kl * resp_mask).sum(1), P=P)


def ppo_update(policy, critic, p_opt, c_opt, batch, args):
    n = batch["seq"].size(0)
    P = batch["P"]
    stats = torch.zeros(3, device=batch["seq"].device)
    for _ in range(args.ppo_epochs):
        perm = torch.randperm(n, device=batch["seq"].device)
        for s in range(0, n, args.mini_bs):
            idx = perm[s:s + args.mini_bs]
            seq, mask, rm_ = batch["seq"][idx], batch["mask"][idx], batch["resp_mask"][idx]
            new_logp = token_logprobs(policy, seq, mask)[:, P - 1:]
            ratio = (new_logp - batch["logp"][idx]).exp()
            adv = batch["adv"][idx]
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip, 1 + args.clip))
            pg_loss = (pg * rm_).sum() / rm_.sum()
            p_opt.zero_grad(set_to_none=True)
            pg_loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            p_opt.step()

            v = critic(seq, mask)[:, P - 1:-1]
            old_v = batch["values"][idx]
            v_clip = old_v + (v - old_v).clamp(-args.vf_clip, args.vf_clip)
            ret = batch["returns"][idx]
            vf = torch.max((v - ret) ** 2, (v_clip - ret) ** 2)
            vf_loss = 0.5 * (vf * rm_).sum() / rm_.sum()
            c_opt.zero_grad(set_to_none=True)
            vf_loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            c_opt.step()
            stats += torch.stack([pg_loss.detach(), vf_loss.detach(), ((ratio - 1).abs() * rm_).sum().detach() / rm_.sum()])
    return stats / (args.ppo_epochs * ((n + args.mini_bs - 1) // args.mini_bs))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    tok.pad_token = tok.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.policy).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.policy).to(device).eval().requires_grad_(False)
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model, num_labels=1).to(device)
    rm.config.pad_token_id = tok.pad_token_id
    rm.eval().requires_grad_(False)
    critic = Critic(args.reward_model).to(device)

    policy = DDP(policy, device_ids=[local_rank])
    critic = DDP(critic, device_ids=[local_rank])
    p_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, eps=1e-5)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, eps=1e-5)

    train = Prompts(args.prompts)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.rollout_bs, sampler=sampler, drop_last=True)
    ev = Prompts(args.eval_prompts)
    eval_loader = DataLoader(ev, batch_size=args.rollout_bs,
                             sampler=DistributedSampler(ev, shuffle=False, drop_last=True), drop_last=True)

    it, epoch = 0, 0
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for prompts in loader:
            t0 = time.time()
            policy.eval()
            critic.eval()
            batch = rollout(policy, ref, critic, rm, tok, list(prompts), args, device)
            policy.train()
            critic.train()
            pg, vf, ratio_dev = ppo_update(policy, critic, p_opt, c_opt, batch, args)

            logs = torch.stack([batch["score"].mean(), batch["kl"].mean(), pg, vf, ratio_dev,
                                batch["resp_mask"].sum(1).mean()])
            dist.all_reduce(logs, op=dist.ReduceOp.AVG)
            wandb.log({"reward": logs[0].item(), "kl": logs[1].item(), "pg_loss": logs[2].item(),
                       "vf_loss": logs[3].item(), "ratio_dev": logs[4].item(), "resp_len": logs[5].item(),
                       "sec_per_iter": time.time() - t0}, step=it)
            if rank == 0 and it % 10 == 0:
                print(f"it {it} reward {logs[0]:.3f} kl {logs[1]:.3f} vf {logs[3]:.4f}", flush=True)

            it += 1
            if it % 100 == 0:
                policy.eval()
                tot = torch.zeros(2, device=device)
                for ep in eval_loader:
                    b = rollout(policy, ref, critic, rm, tok, list(ep), args, device)
                    tot += torch.stack([b["score"].sum(), torch.tensor(float(len(ep)), device=device)])
                dist.all_reduce(tot)
                policy.train()
                wandb.log({"eval/reward": (tot[0] / tot[1]).item()}, step=it)
                if rank == 0:
                    policy.module.save_pretrained(os.path.join(args.out, f"policy_it{it}"))
                    tok.save_pretrained(os.path.join(args.out, f"policy_it{it}"))
                    torch.save(critic.module.state_dict(), os.path.join(args.out, f"critic_it{it}.pt"))
                dist.barrier()
            if it >= args.iterations:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
