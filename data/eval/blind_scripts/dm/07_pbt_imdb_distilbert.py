"""PBT fine-tuning of DistilBERT on IMDB sentiment, one member per GPU.

Members explore learning rate, weight decay and warmup; every
``--interval`` optimisation steps the bottom 20% clone a top-20% member
(weights, optimizer and scheduler state) and perturb its hyper-parameters.

    torchrun --nproc_per_node=8 pbt_imdb.py --model distilbert-base-uncased
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, TensorDataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilbert-base-uncased")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--total-steps", type=int, default=6000)
    ap.add_argument("--interval", type=int, default=500)
    ap.add_argument("--frac", type=float, default=0.2)
    ap.add_argument("--cache-dir", default="cache/imdb")
    ap.add_argument("--out", default="runs/pbt_imdb")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def tokenized_splits(args):
    """Tokenize once and keep the tensors in a .pt file; later runs load it."""
    os.makedirs(args.cache_dir, exist_ok=True)
    cache = os.path.join(args.cache_dir, f"{args.model.replace('/', '_')}_{args.max_len}.pt")
    if os.path.exists(cache):
        return torch.load(cache)

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("imdb")
    split = raw["train"].train_test_split(test_size=0.1, seed=args.seed)
    tensors = {}
    for name, ds in (("train", split["train"]), ("val", split["test"]), ("test", raw["test"])):
        enc = tok(ds["text"], truncation=True, max_length=args.max_len,
                  padding="max_length", return_tensors="pt")
        tensors[name] = (enc["input_ids"], enc["attention_mask"],
                         torch.tensor(ds["label"], dtype=torch.long))
    torch.save(tensors, cache)
    return tensors


def sample_hp(rng):
    return {"lr": 10 ** rng.uniform(-5.3, -4.3),
            "weight_decay": rng.choice([0.0, 0.01, 0.05, 0.1]),
            "warmup_ratio": rng.uniform(0.0, 0.15)}


def make_optim(model, hp, total_steps):
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": hp["weight_decay"]},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=hp["lr"])
    sched = get_linear_schedule_with_warmup(opt, int(hp["warmup_ratio"] * total_steps), total_steps)
    return opt, sched


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total


def infinite(loader):
    while True:
        for batch in loader:
            yield batch


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    rng = random.Random(args.seed + 7919 * rank)
    torch.manual_seed(args.seed + rank)

    data = tokenized_splits(args)
    train_loader = DataLoader(TensorDataset(*data["train"]), batch_size=args.batch_size,
                              shuffle=True, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(TensorDataset(*data["val"]), batch_size=128, num_workers=2)

    hp = sample_hp(rng)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    opt, sched = make_optim(model, hp, args.total_steps)
    scaler = torch.cuda.amp.GradScaler()

    member_dir = os.path.join(args.out, "members")
    if rank == 0:
        os.makedirs(member_dir, exist_ok=True)
    dist.barrier()

    log = []
    batches = infinite(train_loader)
    model.train()
    for step in range(1, args.total_steps + 1):
        ids, mask, labels = (t.to(device, non_blocking=True) for t in next(batches))
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()

        if step % args.interval:
            continue
        acc = evaluate(model, val_loader, device)
        log.append({"step": step, "acc": acc, "lr": sched.get_last_lr()[0], **hp})

        scores = [None] * world
        dist.all_gather_object(scores, (acc, rank))
        ranked = sorted(scores, reverse=True)
        k = max(1, int(world * args.frac))
        top = [r for _, r in ranked[:k]]
        bottom = [r for _, r in ranked[-k:]]
        if rank == 0:
            print(f"step {step}: " + ", ".join(f"{r}:{a:.4f}" for a, r in ranked), flush=True)

        if rank in top:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "hp": hp},
                       os.path.join(member_dir, f"{rank}.pt"))
        dist.barrier()
        if rank in bottom and step < args.total_steps:
            donor = rng.choice(top)
            ck = torch.load(os.path.join(member_dir, f"{donor}.pt"), map_location=device)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            scaler.load_state_dict(ck["scaler"])
            hp = {**ck["hp"], "lr": ck["hp"]["lr"] * rng.choice([0.8, 1.2]),
                  "weight_decay": rng.choice([0.0, 0.01, 0.05, 0.1])}
            # scheduler multiplies base_lrs by its factor, so change those too
            sched.base_lrs = [hp["lr"] for _ in sched.base_lrs]
            for g, wd in zip(opt.param_groups, (hp["weight_decay"], 0.0)):
                g["weight_decay"] = wd
            print(f"[member {rank}] step {step}: cloned member {donor}, lr -> {hp['lr']:.2e}",
                  flush=True)
        dist.barrier()

    with open(os.path.join(args.out, f"member_{rank}_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    final = [None] * world
    dist.all_gather_object(final, (log[-1]["acc"], rank))
    best_acc, best_rank = max(final)
    if rank == best_rank:
        model.save_pretrained(os.path.join(args.out, "best"))
        AutoTokenizer.from_pretrained(args.model).save_pretrained(os.path.join(args.out, "best"))
        print(f"best member {best_rank}: val acc {best_acc:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
