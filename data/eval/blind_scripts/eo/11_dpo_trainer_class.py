"""Minimal DPO trainer (no TRL) used for the beta / data-mix sweeps.

    torchrun --nproc_per_node=8 11_dpo_trainer_class.py --policy ckpts/qwen2.5-3b-sft \
        --train_jsonl data/mix_a_train.jsonl --eval_jsonl data/mix_a_eval.jsonl --beta 0.05 --run_name mixA-b005
"""
import argparse
import json
import math
import os
import time
from dataclasses import MISSING, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE = -100


@dataclass
class Cfg:
    policy: str
    train_jsonl: str
    eval_jsonl: str
    run_name: str
    out_root: str = "runs"
    beta: float = 0.1
    lr: float = 5e-7
    warmup_ratio: float = 0.1
    per_device_bs: int = 4
    epochs: int = 1
    max_len: int = 1024
    max_prompt_len: int = 512
    eval_every: int = 200


def parse() -> Cfg:
    ap = argparse.ArgumentParser()
    for name, f in Cfg.__dataclass_fields__.items():
        if f.default is MISSING:
            ap.add_argument(f"--{name}", required=True, type=str)
        else:
            ap.add_argument(f"--{name}", type=type(f.default), default=f.default)
    return Cfg(**vars(ap.parse_args()))


class PrefJsonl(Dataset):
    def __init__(self, path, tok, cfg):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                            add_generation_prompt=True)
                c = tok(r["chosen"] + "<|im_end|>", add_special_tokens=False).input_ids
                j = tok(r["rejected"] + "<|im_end|>", add_special_tokens=False).input_ids
                if len(p) + max(len(c), len(j)) > cfg.max_len:
                    p = p[-cfg.max_prompt_len:]
                self.rows.append((p, c[: cfg.max_len - len(p)], j[: cfg.max_len - len(p)]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        rows = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(a) + len(b) for a, b in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(rows), T), dtype=torch.long)
        for k, (a, b) in enumerate(rows):
            ids[k, : len(a) + len(b)] = torch.tensor(a + b)
            lab[k, len(a): len(a) + len(b)] = torch.tensor(b)
            att[k, : len(a) + len(b)] = 1
        return {"input_ids": ids, "attention_mask": att, "labels": lab}


def response_logps(logits, labels):
    logits = logits[:, :-1].float()
    tgt = labels[:, 1:]
    m = tgt != IGNORE
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (lp * m).sum(-1)


class DPOTrainer:
    def __init__(self, cfg: Cfg, rank, world, local_rank):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device("cuda", local_rank)
        self.out_dir = os.path.join(cfg.out_root, cfg.run_name)

        self.tok = AutoTokenizer.from_pretrained(cfg.policy)
        train = PrefJsonl(cfg.train_jsonl, self.tok, cfg)
        evals = PrefJsonl(cfg.eval_jsonl, self.tok, cfg)
        self.sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
        coll = Collator(self.tok.pad_token_id)
        self.train_dl = DataLoader(train, batch_size=cfg.per_device_bs, sampler=self.sampler, collate_fn=coll,
                                   num_workers=2, pin_memory=True)
        self.eval_dl = DataLoader(evals, batch_size=cfg.per_device_bs, collate_fn=coll, num_workers=2,
                                  sampler=DistributedSampler(evals, shuffle=False, drop_last=True))

        policy = AutoModelForCausalLM.from_pretrained(cfg.policy, torch_dtype=torch.float32)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.config.use_cache = False
        self.model = DDP(policy.to(self.device), device_ids=[local_rank])
        # frozen reference in bf16, placed by accelerate
        self.ref = AutoModelForCausalLM.from_pretrained(cfg.policy, torch_dtype=torch.bfloat16, device_map="auto")
        self.ref.eval().requires_grad_(False)

        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.total = len(self.train_dl) * cfg.epochs
        self.sched = get_cosine_schedule_with_warmup(self.opt, math.ceil(cfg.warmup_ratio * self.total), self.total)
        self.step = 0

    def logps(self, model, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = response_logps(logits, batch["labels"])
        n = lp.shape[0] // 2
        return lp[:n], lp[n:]

    def ref_logps(self, batch):
        with torch.no_grad():
            b = {k: v.to(self.ref.device) for k, v in batch.items()}
            c, r = self.logps(self.ref, b)
        return c.to(self.device), r.to(self.device)

    def loss(self, batch):
        pc, pr = self.logps(self.model, batch)
        rc, rr = self.ref_logps(batch)
        z = self.cfg.beta * ((pc - pr) - (rc - rr))
        return -F.logsigmoid(z).mean(), (self.cfg.beta * (pc - rc)).detach(), (self.cfg.beta * (pr - rr)).detach()

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        s = torch.zeros(4, device=self.device)
        for batch in self.eval_dl:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            loss, ch, rj = self.loss(batch)
            s += torch.stack([loss * ch.numel(), (ch > rj).float().sum(), (ch - rj).sum(), s.new_tensor(ch.numel())])
        dist.all_reduce(s)
        self.model.train()
        return {"eval/loss": (s[0] / s[3]).item(), "eval/acc": (s[1] / s[3]).item(), "eval/margin": (s[2] / s[3]).item()}

    def train(self):
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            wandb.init(project="dpo-sweeps", name=self.cfg.run_name, config=vars(self.cfg))
        t0 = time.time()
        for epoch in range(self.cfg.epochs):
            self.sampler.set_epoch(epoch)
            for batch in self.train_dl:
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                loss, ch, rj = self.loss(batch)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                self.step += 1
                if self.step % 10 == 0:
                    m = torch.stack([loss.detach(), (ch > rj).float().mean(), (ch - rj).mean(), ch.mean(), rj.mean()])
                    dist.all_reduce(m, op=dist.ReduceOp.AVG)
                    if self.rank == 0:
                        wandb.log({"train/loss": m[0].item(), "train/acc": m[1].item(), "train/margin": m[2].item(),
                                   "train/r_chosen": m[3].item(), "train/r_rejected": m[4].item(),
                                   "train/grad_norm": gn.item(), "lr": self.sched.get_last_lr()[0],
                                   "elapsed": time.time() - t0}, step=self.step)
                if self.step % self.cfg.eval_every == 0:
                    metrics = self.evaluate()
                    if self.rank == 0:
                        wandb.log(metrics, step=self.step)
        if self.rank == 0:
            self.model.module.save_pretrained(os.path.join(self.out_dir, "final"))
            self.tok.save_pretrained(os.path.join(self.out_dir, "final"))
            wandb.finish()
        dist.barrier()


def main():
    cfg = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)
    DPOTrainer(cfg, rank, world, local_rank).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
