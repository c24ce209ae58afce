"""PPO-RLHF with preemption-safe checkpoints (the cluster preempts jobs every few hours).

Resubmit the same command and it continues from <out>/latest.pt:

    torchrun --nproc_per_node=8 18_ppo_qwen_cluster.py --sft ckpt/sft-qwen1.5b --rm ckpt/rm-qwen1.5b --out ckpt/ppo-qwen1.5b
"""
import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


@dataclass
class Cfg:
    sft: str
    rm: str
    out: str
    prompts: str = "data/prompts.jsonl"
    batch: int = 16
    minibatch: int = 4
    ppo_epochs: int = 2
    total_iters: int = 2000
    max_new: int = 200
    lr: float = 1e-6
    beta: float = 0.04
    clip: float = 0.2
    vf_coef: float = 0.25
    lam: float = 0.95
    ckpt_every: int = 50
    seed: int = 5


class ValueLM(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.value = nn.Sequential(nn.Linear(self.lm.config.hidden_size, 256), nn.Tanh(), nn.Linear(256, 1))

    def forward(self, ids, attn):
        o = self.lm(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        return o.logits, self.value(o.hidden_states[-1].float()).squeeze(-1)


def tok_logp(logits, ids):
    return F.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def save_ckpt(path, policy, opt, it, epoch, cfg):
    tmp = path + ".tmp"
    torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(), "iter": it, "epoch": epoch,
                "cfg": asdict(cfg)}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    for name, f in Cfg.__dataclass_fields__.items():
        if f.default is f.default_factory:  # required
            ap.add_argument(f"--{name}", required=True)
        else:
            ap.add_argument(f"--{name}", type=type(f.default), default=f.default)
    cfg = Cfg(**vars(ap.parse_args()))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.sft, padding_side="left")
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    policy = ValueLM(cfg.sft).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(cfg.sft, torch_dtype=torch.bfloat16).to(dev).eval().requires_grad_(False)
    rm = AutoModelForSequenceClassification.from_pretrained(cfg.rm, torch_dtype=torch.bfloat16).to(dev)
    rm.eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=1e-6)

    start_iter, start_epoch = 0, 0
    latest = os.path.join(cfg.out, "latest.pt")
    if os.path.exists(latest):
        ck = torch.load(latest)
        policy.load_state_dict(ck["policy"])
        opt.load_state_dict(ck["opt"])
        start_iter, start_epoch = ck["iter"], ck["epoch"]
        if rank == 0:
            print(f"resuming from {latest} at iter {start_iter}", flush=True)
        del ck
    model = DDP(policy, device_ids=[local_rank])

    with open(cfg.prompts) as f:
        prompts = [json.loads(l)["prompt"] for l in f]
    sampler = DistributedSampler(prompts, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(prompts, batch_size=cfg.batch, sampler=sampler, drop_last=True)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    it, epoch, t0 = start_iter, start_epoch, time.time()
    skip = start_iter % len(loader)
    while it < cfg.total_iters:
        sampler.set_epoch(epoch)
        for bi, batch in enumerate(loader):
            if skip and bi < skip:
                continue
            skip = 0
            enc = tok(list(batch), return_tensors="pt", padding=True, truncation=True, max_length=512).to(dev)
            P = enc.input_ids.size(1)
            with torch.no_grad():
                policy.eval()
                seq = policy.lm.generate(**enc, do_sample=True, max_new_tokens=cfg.max_new, top_k=0, top_p=1.0,
                                         pad_token_id=pad)
                resp = seq[:, P:]
                is_eos = resp == eos
                end = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(resp[:, 0], resp.size(1) - 1))
                rmask = (torch.arange(resp.size(1), device=dev)[None] <= end[:, None]).float()
                attn = torch.cat([enc.attention_mask, rmask.long()], 1)
                logits, values = policy(seq, attn)
                old_lp = tok_logp(logits[:, P - 1:-1], resp)
                values = values[:, P - 1:-1] * rmask
                ref_lp = tok_logp(ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)
                score = rm(input_ids=seq, attention_mask=attn).logits[:, 0].float()
                kl = (old_lp - ref_lp) * rmask
                rew = -cfg.beta * kl
                rew[torch.arange(seq.size(0), device=dev), end] += score
                adv = torch.zeros_like(rew)
                g = torch.zeros_like(score)
                for t in reversed(range(resp.size(1))):
                    nv = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(g)
                    g = rew[:, t] + nv - values[:, t] + cfg.lam * g
                    adv[:, t] = g
                ret = adv + values
                mu = (adv * rmask).sum() / rmask.sum()
                sd = (((adv - mu) ** 2 * rmask).sum() / rmask.sum()).sqrt()
                adv = (adv - mu) / (sd + 1e-8) * rmask
                policy.train()

            for _ in range(cfg.ppo_epochs):
                for idx in torch.randperm(seq.size(0), device=dev).split(cfg.minibatch):
                    lg, v = model(seq[idx], attn[idx])
                    lp = tok_logp(lg[:, P - 1:-1], resp[idx])
                    mk = rmask[idx]
                    ratio = (lp - old_lp[idx]).exp()
                    a = adv[idx]
                    pg = (torch.max(-a * ratio, -a * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)) * mk).sum() / mk.sum()
                    vf = 0.5 * (((v[:, P - 1:-1] - ret[idx]) ** 2) * mk).sum() / mk.sum()
                    opt.zero_grad(set_to_none=True)
                    (pg + cfg.vf_coef * vf).backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()

            it += 1
            s = torch.stack([score.mean(), kl.sum(1).mean(), rmask.sum(1).mean()])
            dist.all_reduce(s, op=dist.ReduceOp.AVG)
            if rank == 0 and it % 10 == 0:
                print(f"iter {it} score {s[0]:.3f} kl {s[1]:.3f} len {s[2]:.1f} {time.time() - t0:.0f}s", flush=True)
            if it % cfg.ckpt_every == 0 or it == cfg.total_iters:
                if rank == 0:
                    save_ckpt(latest, policy, opt, it, epoch, cfg)
                dist.barrier()
            if it >= cfg.total_iters:
                break
        epoch += 1

    if rank == 0:
        policy.lm.save_pretrained(os.path.join(cfg.out, "final"))
        torch.save(policy.value.state_dict(), os.path.join(cfg.out, "final", "value_head.pt"))
        tok.save_pretrained(os.path.join(cfg.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
