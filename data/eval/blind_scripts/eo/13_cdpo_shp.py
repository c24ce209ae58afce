"""Conservative DPO (label-smoothed) on Stanford Human Preferences.

SHP pairs are noisy, so we keep only pairs whose score ratio is >= --min_ratio and
use label smoothing eps on the DPO objective.

    torchrun --nproc_per_node=4 13_cdpo_shp.py --model ckpts/pythia-1b-sft-shp --out runs/cdpo-shp
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE = -100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=0.1, help="label smoothing")
    p.add_argument("--min_ratio", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--max_prompt_len", type=int, default=384)
    return p.parse_args()


class SHPPairs(Dataset):
    def __init__(self, split, tok, args):
        self.items = []
        for ex in split:
            if ex["score_ratio"] < args.min_ratio:
                continue
            prompt = "POST: " + ex["history"].strip() + "\n\nCOMMENT:"
            a, b = " " + ex["human_ref_A"].strip(), " " + ex["human_ref_B"].strip()
            chosen, rejected = (a, b) if ex["labels"] == 1 else (b, a)
            p = tok(prompt).input_ids[-args.max_prompt_len:]
            c = (tok(chosen).input_ids + [tok.eos_token_id])[: args.max_len - len(p)]
            r = (tok(rejected).input_ids + [tok.eos_token_id])[: args.max_len - len(p)]
            self.items.append((p, c, r))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        rows = [(p, c) for p, c, _ in batch] + [(p, r) for p, _, r in batch]
        T = max(len(p) + len(x) for p, x in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(rows), T), dtype=torch.long)
        for i, (p, x) in enumerate(rows):
            ids[i, : len(p) + len(x)] = torch.tensor(p + x)
            lab[i, len(p): len(p) + len(x)] = torch.tensor(x)
            att[i, : len(p) + len(x)] = 1
        return ids, att, lab


def response_logps(model, ids, att, lab):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits[:, :-1].float()
    tgt = lab[:, 1:]
    mask = tgt != IGNORE
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = (lp * mask).sum(-1)
    n = lp.size(0) // 2
    return lp[:n], lp[n:]


def cdpo_loss(pc, pr, rc, rr, beta, eps):
    z = beta * ((pc - pr) - (rc - rr))
    loss = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    return loss.mean(), z.detach()


@torch.no_grad()
def evaluate(model, ref, loader, device, args):
    model.eval()
    tot = torch.zeros(3, device=device)
    for ids, att, lab in loader:
        ids, att, lab = ids.to(device), att.to(device), lab.to(device)
        pc, pr = response_logps(model, ids, att, lab)
        rc, rr = response_logps(ref, ids, att, lab)
        loss, z = cdpo_loss(pc, pr, rc, rr, args.beta, args.eps)
        tot += torch.stack([loss * z.numel(), (z > 0).float().sum(), tot.new_tensor(z.numel())])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    shp = load_dataset("stanfordnlp/SHP")
    train_set = SHPPairs(shp["train"], tok, args)
    val_set = SHPPairs(shp["validation"], tok, args)

    collate = PadCollate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.bs, sampler=val_sampler, collate_fn=collate, num_workers=2)

    policy = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    policy.config.use_cache = False
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ref_model = ref_model.cuda().eval()
    for p in ref_model.parameters():
        p.requires_grad = False
    model = DDP(policy, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = len(train_loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total_steps)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train pairs {len(train_set)} (ratio >= {args.min_ratio}), val pairs {len(val_set)}, "
              f"{total_steps} steps", flush=True)

    history = []
    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for ids, att, lab in train_loader:
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            pc, pr = response_logps(model, ids, att, lab)
            with torch.no_grad():
                rc, rr = response_logps(ref_model, ids, att, lab)
            loss, z = cdpo_loss(pc, pr, rc, rr, args.beta, args.eps)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                s = torch.stack([loss.detach(), (z > 0).float().mean(), z.mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total_steps} loss {s[0]:.4f} acc {s[1]:.3f} margin {s[2]:.3f} "
                          f"({time.time() - t0:.0f}s)", flush=True)

            if step % 500 == 0 or step == total_steps:
                vloss, vacc = evaluate(model, ref_model, val_loader, device, args)
                if rank == 0:
                    history.append({"step": step, "val_loss": vloss, "val_acc": vacc})
                    print(f"[val] step {step} loss {vloss:.4f} acc {vacc:.4f}", flush=True)

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
        with open(os.path.join(args.out, "val_history.json"), "w") as f:
            json.dump(history, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
