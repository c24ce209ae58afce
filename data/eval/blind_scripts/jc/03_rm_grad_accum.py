"""Reward model on pairwise human preferences (Anthropic HH style), DDP + grad accumulation.

torchrun --nnodes=1 --nproc_per_node=4 03_rm_grad_accum.py --config configs/rm_llama1b.json
"""
import argparse
import contextlib
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("rm")

DEFAULTS = dict(
    base_model="meta-llama/Llama-3.2-1B",
    train_path="data/hh_rlhf/train.jsonl",
    test_path="data/hh_rlhf/test.jsonl",
    cache_dir="cache/hh_tok",
    out_dir="out/rm_llama1b",
    max_len=1024,
    micro_batch=4,
    grad_accum=8,
    lr=9e-6,
    epochs=1,
    warmup_steps=50,
    eval_every=200,
    seed=1234,
    resume=None,
)


class RewardModel(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.body = AutoModel.from_pretrained(base, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
        self.value = nn.Linear(self.body.config.hidden_size, 1, bias=False)
        nn.init.normal_(self.value.weight, std=1 / (self.body.config.hidden_size + 1) ** 0.5)

    def forward(self, input_ids, attention_mask):
        hs = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1
        pooled = hs[torch.arange(hs.size(0), device=hs.device), last]
        return self.value(pooled.float()).squeeze(-1)


def tokenize_file(path, tok, max_len):
    out = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            c = tok(ex["chosen"], truncation=True, max_length=max_len)["input_ids"]
            r = tok(ex["rejected"], truncation=True, max_length=max_len)["input_ids"]
            if c == r:
                continue
            out.append((c, r))
    return out


def load_or_build_cache(cfg, tok, split, path, rank):
    cache_file = os.path.join(cfg["cache_dir"], f"{split}.pt")
    if rank == 0 and not os.path.exists(cache_file):
        os.makedirs(cfg["cache_dir"], exist_ok=True)
        data = tokenize_file(path, tok, cfg["max_len"])
        tmp = cache_file + ".tmp"
        torch.save(data, tmp)
        os.replace(tmp, cache_file)
    dist.barrier()
    return torch.load(cache_file)


class Pairs(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def collate(batch, pad_id):
    seqs = [c for c, _ in batch] + [r for _, r in batch]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.as_tensor(s)
        att[i, :len(s)] = 1
    return ids, att


@torch.no_grad()
def evaluate(model, pairs, rank, world, pad_id, device, bs=16):
    model.eval()
    mine = pairs[rank::world]
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for i in range(0, len(mine), bs):
        ids, att = collate(mine[i:i + bs], pad_id)
        ids, att = ids.to(device), att.to(device)
        r = model(ids, att)
        rc, rr = r.chunk(2)
        correct += (rc > rr).sum()
        count += rc.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    return (correct / count).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    tok = AutoTokenizer.from_pretrained(cfg["base_model"])
    tok.pad_token = tok.pad_token or tok.eos_token
    train_pairs = load_or_build_cache(cfg, tok, "train", cfg["train_path"], rank)
    test_pairs = load_or_build_cache(cfg, tok, "test", cfg["test_path"], rank)
    logger.info("train=%d test=%d", len(train_pairs), len(test_pairs))

    model = RewardModel(cfg["base_model"])
    model.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=False)

    train_ds = Pairs(train_pairs)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=sampler, drop_last=True,
                        collate_fn=lambda b: collate(b, tok.pad_token_id), num_workers=2, pin_memory=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"], weight_decay=0.0)
    updates_per_epoch = len(loader) // cfg["grad_accum"]
    sched = get_linear_schedule_with_warmup(opt, cfg["warmup_steps"], updates_per_epoch * cfg["epochs"])

    start_epoch, global_step = 0, 0
    if cfg["resume"]:
        state = torch.load(cfg["resume"], map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, global_step = state["epoch"] + 1, state["step"]
        logger.info("resumed from %s at step %d", cfg["resume"], global_step)

    best = 0.0
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        acc_loss = torch.zeros((), device=device)
        for micro, (ids, att) in enumerate(loader):
            if micro >= updates_per_epoch * cfg["grad_accum"]:
                break
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            sync_now = (micro + 1) % cfg["grad_accum"] == 0
            ctx = contextlib.nullcontext() if sync_now else ddp.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    r = ddp(ids, att)
                rc, rr = r.float().chunk(2)
                loss = -F.logsigmoid(rc - rr).mean() / cfg["grad_accum"]
                loss.backward()
            acc_loss += loss.detach()
            if not sync_now:
                continue

            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            global_step += 1

            dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
            if global_step % 10 == 0:
                logger.info("ep %d step %d loss %.4f lr %.2e", epoch, global_step, acc_loss.item(),
                            sched.get_last_lr()[0])
            acc_loss.zero_()

            if global_step % cfg["eval_every"] == 0:
                acc = evaluate(model, test_pairs, rank, world, tok.pad_token_id, device)
                logger.info("step %d eval pairwise acc %.4f", global_step, acc)
                if rank == 0 and acc > best:
                    best = acc
                    os.makedirs(cfg["out_dir"], exist_ok=True)
                    torch.save(model.state_dict(), os.path.join(cfg["out_dir"], "best_rm.pt"))

        if rank == 0:
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": global_step},
                       os.path.join(cfg["out_dir"], f"epoch{epoch}.pt"))
        dist.barrier()

    acc = evaluate(model, test_pairs, rank, world, tok.pad_token_id, device)
    logger.info("final eval pairwise acc %.4f (best %.4f)", acc, max(best, acc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
