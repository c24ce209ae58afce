"""
GRPO on MATH (lighteval/MATH, levels 3-5) with DDP.

Groups in which every sample gets the same reward carry no learning signal,
so batches that end up with zero advantage everywhere are dropped instead of
spending a backward pass on them (DAPO-style dynamic filtering).

    torchrun --nnodes=1 --nproc_per_node=8 09_grpo_math_filtered.py \
        --model meta-llama/Llama-3.2-1B-Instruct --save_dir ckpt/grpo_math_l1b
"""
import argparse
import json
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class Config:
    model: str = "meta-llama/Llama-3.2-1B-Instruct"
    save_dir: str = "ckpt/grpo_math"
    prompts_per_rank: int = 4
    group_size: int = 8
    max_new_tokens: int = 1024
    temperature: float = 1.0
    lr: float = 2e-6
    clip_low: float = 0.2
    clip_high: float = 0.28
    iters: int = 600
    save_every: int = 100
    seed: int = 0


def parse() -> Config:
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


def last_boxed(s):
    idx = s.rfind("\\boxed{")
    if idx < 0:
        return None
    depth, i = 0, idx + len("\\boxed{")
    start = i
    while i < len(s):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            if depth == 0:
                return s[start:i]
            depth -= 1
        i += 1
    return None


def strip(a):
    return re.sub(r"\s+|\\left|\\right|\\!|\$", "", a or "").replace("dfrac", "frac")


class GRPO:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(cfg.seed + self.rank)

        self.tok = AutoTokenizer.from_pretrained(cfg.model, padding_side="left")
        if self.tok.pad_token is None:
            self.tok.pad_token = "<|finetune_right_pad_id|>"
        net = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.bfloat16).to(self.device)
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy = DDP(net, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.01)

        ds = load_dataset("lighteval/MATH", "all", split="train")
        ds = ds.filter(lambda ex: ex["level"] in ("Level 3", "Level 4", "Level 5"))
        ds = ds.map(self._fmt, remove_columns=ds.column_names)
        self.sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
        self.loader = DataLoader(ds, batch_size=cfg.prompts_per_rank, sampler=self.sampler,
                                 collate_fn=lambda b: b, num_workers=1)

    def _fmt(self, ex):
        msgs = [{"role": "user", "content": ex["problem"] + "\n\nPut the final answer in \\boxed{}."}]
        return {"prompt": self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                "answer": strip(last_boxed(ex["solution"]))}

    def batches(self):
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    @torch.no_grad()
    def rollout(self, batch):
        cfg, tok = self.cfg, self.tok
        enc = tok([b["prompt"] for b in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(self.device)
        net = self.policy.module
        net.eval()
        out = net.generate(**enc, do_sample=True, temperature=cfg.temperature, top_p=1.0,
                           max_new_tokens=cfg.max_new_tokens, num_return_sequences=cfg.group_size,
                           pad_token_id=tok.pad_token_id, use_cache=True)
        net.train()
        P = enc.input_ids.shape[1]
        comp = out[:, P:]
        eos = torch.isin(comp, torch.tensor([tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")],
                                            device=self.device))
        after = torch.cumsum(eos.int(), 1) - eos.int() > 0
        cmask = (~after & (comp != tok.pad_token_id)).float()
        attn = torch.cat([enc.attention_mask.repeat_interleave(cfg.group_size, 0), cmask.long()], 1)
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        gold = [b["answer"] for b in batch for _ in range(cfg.group_size)]
        rewards = torch.tensor([float(strip(last_boxed(t)) == g and g != "") for t, g in zip(texts, gold)],
                               device=self.device)
        old_lp = self.token_logps(net, out, attn, P)
        return out, attn, cmask, rewards, old_lp, P

    @staticmethod
    def token_logps(model, ids, attn, P):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
        return torch.gather(logits.log_softmax(-1), 2, ids[:, P:].unsqueeze(-1)).squeeze(-1)

    def train(self):
        cfg = self.cfg
        it = self.batches()
        for step in range(1, cfg.iters + 1):
            t0 = time.time()
            seqs, attn, cmask, rewards, old_lp, P = self.rollout(next(it))
            grp = rewards.view(-1, cfg.group_size)
            adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).view(-1, 1)

            solved = torch.stack([rewards.mean(), (grp.std(1) == 0).float().mean()])
            dist.all_reduce(solved, op=dist.ReduceOp.AVG)
            if self.rank == 0:
                print(f"step {step} reward {solved[0]:.3f} flat_groups {solved[1]:.2f}", flush=True)

            if adv.abs().sum() == 0:
                continue

            lp = self.token_logps(self.policy, seqs, attn, P)
            ratio = torch.exp(lp - old_lp)
            clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
            per_tok = -torch.min(ratio * adv, clipped * adv)
            loss = (per_tok * cmask).sum() / cmask.sum().clamp(min=1)

            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.opt.step()

            if self.rank == 0 and step % 10 == 0:
                print(f"step {step} gnorm {gn.item():.3f} {time.time() - t0:.1f}s", flush=True)
            if step % cfg.save_every == 0:
                self.save(step)

    def save(self, step):
        if self.rank == 0:
            d = os.path.join(self.cfg.save_dir, f"iter_{step:05d}")
            self.policy.module.save_pretrained(d)
            self.tok.save_pretrained(d)
            with open(os.path.join(d, "grpo_config.json"), "w") as f:
                json.dump(vars(self.cfg), f, indent=2)
        dist.barrier()

    def close(self):
        dist.destroy_process_group()


if __name__ == "__main__":
    trainer = GRPO(parse())
    try:
        trainer.train()
    finally:
        trainer.close()
