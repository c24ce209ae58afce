"""
PPO on summarisation prompts (TL;DR) with a value-head policy.

Launch (2 nodes x 8 GPUs):
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
      06_ppo_tldr_valuehead.py --policy ckpt/sft_tldr --reward ckpt/rm_tldr
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--reward", required=True)
    p.add_argument("--save_dir", default="/shared/ckpt/ppo_tldr")
    p.add_argument("--prompts_per_gpu", type=int, default=16)
    p.add_argument("--ppo_minibatch", type=int, default=4)
    p.add_argument("--ppo_epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.05)
    p.add_argument("--eps_clip", type=float, default=0.2)
    p.add_argument("--value_coef", type=float, default=0.5)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class ValueHeadLM(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.base = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.value_head = nn.Linear(self.base.config.hidden_size, 1)
        self.value_head.weight.data.zero_()
        self.value_head.bias.data.zero_()

    def forward(self, ids, mask):
        o = self.base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        v = self.value_head(o.hidden_states[-1].float()).squeeze(-1)
        return o.logits, v


def gather_logprobs(logits, ids):
    return logits.float().log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)


def gae(rewards, values, mask, lam, gamma=1.0):
    T = rewards.size(1)
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        nv = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else 0.0
        delta = rewards[:, t] + gamma * nv - values[:, t]
        running = delta + gamma * lam * running
        adv[:, t] = running * mask[:, t]
    return adv, adv + values


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device(f"cuda:{lr_}")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    eos = tok.eos_token_id

    policy = ValueHeadLM(args.policy).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(dev).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    rm.requires_grad_(False)
    model = DDP(policy, device_ids=[lr_])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ds = load_dataset("trl-lib/tldr", split="train")
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.prompts_per_gpu, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: [x["prompt"] for x in b])

    def prompt_iter():
        ep = 0
        while True:
            sampler.set_epoch(ep)
            yield from loader
            ep += 1

    prompts_stream = prompt_iter()
    history = defaultdict(list)
    t_start = time.time()

    for step in range(1, args.steps + 1):
        prompts = next(prompts_stream)
        enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=448).to(dev)
        P = enc.input_ids.size(1)

        # ---------------- rollout ----------------
        policy.eval()
        with torch.no_grad():
            out = policy.base.generate(**enc, max_new_tokens=args.gen_len, do_sample=True, top_k=0,
                                       top_p=1.0, pad_token_id=eos)
            resp = out[:, P:]
            if resp.size(1) < args.gen_len:
                resp = F.pad(resp, (0, args.gen_len - resp.size(1)), value=eos)
                out = torch.cat([enc.input_ids, resp], 1)
            has_eos = (resp == eos).any(1)
            # drop samples that ran out of tokens before finishing the summary
            keep = has_eos.nonzero(as_tuple=True)[0]
            out, resp = out[keep], resp[keep]
            prompt_mask = enc.attention_mask[keep]
            end = (resp == eos).int().argmax(1)
            ar = torch.arange(resp.size(1), device=dev)
            resp_mask = (ar[None] <= end[:, None]).float()
            attn = torch.cat([prompt_mask, resp_mask.long()], 1)

            logits, values = policy(out, attn)
            logp = gather_logprobs(logits[:, P - 1:-1], resp)
            values = values[:, P - 1:-1] * resp_mask
            ref_logp = gather_logprobs(ref(input_ids=out, attention_mask=attn).logits[:, P - 1:-1], resp)
            score = rm(input_ids=out, attention_mask=attn).logits[:, 0].float()

            kl = (logp - ref_logp) * resp_mask
            rew = -args.beta * kl
            rew[torch.arange(len(keep), device=dev), end] += score
            adv, ret = gae(rew, values, resp_mask, args.lam)
            m = resp_mask.bool()
            adv = (adv - adv[m].mean()) / (adv[m].std() + 1e-8) * resp_mask
        policy.train()

        # ---------------- optimisation ----------------
        n = out.size(0)
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, device=dev)
            for i in range(0, n, args.ppo_minibatch):
                b = perm[i:i + args.ppo_minibatch]
                new_logits, v = model(out[b], attn[b])
                new_logp = gather_logprobs(new_logits[:, P - 1:-1], resp[b])
                v = v[:, P - 1:-1]
                mk = resp_mask[b]
                ratio = (new_logp - logp[b]).exp()
                surr = torch.min(ratio * adv[b], ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip) * adv[b])
                pol_loss = -(surr * mk).sum() / mk.sum()
                val_loss = (((v - ret[b]) ** 2) * mk).sum() / mk.sum()
                loss = pol_loss + args.value_coef * val_loss
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

        # ---------------- logging ----------------
        stat = torch.tensor([score.sum().item(), kl.sum().item(), float(n), float(len(prompts))], device=dev)
        dist.all_reduce(stat)
        if rank == 0:
            history["score"].append(stat[0].item() / max(stat[2].item(), 1))
            history["kl"].append(stat[1].item() / max(stat[2].item(), 1))
            history["kept"].append(stat[2].item() / stat[3].item())
            if step % 10 == 0:
                print(f"[{step}] score={np.mean(history['score'][-10:]):.3f} "
                      f"kl={np.mean(history['kl'][-10:]):.3f} kept={np.mean(history['kept'][-10:]):.2f} "
                      f"t={time.time() - t_start:.0f}s", flush=True)
            if step % 250 == 0 or step == args.steps:
                d = os.path.join(args.save_dir, f"step{step:05d}")
                policy.base.save_pretrained(d, safe_serialization=True)
                tok.save_pretrained(d)
                torch.save(policy.value_head.state_dict(), os.path.join(d, "value_head.pt"))
                with open(os.path.join(d, "history.json"), "w") as f:
                    json.dump(history, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
