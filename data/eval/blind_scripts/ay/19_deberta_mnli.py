"""DeBERTa-v3-large on MNLI. Dynamic padding, bf16 autocast, torch.compile(dynamic=True), fused AdamW.

    torchrun --nproc_per_node=4 19_deberta_mnli.py --out /shared/glue/mnli_debv3l
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/deberta-v3-large")
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--bs", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    p.add_argument("--eval-every", type=int, default=2000)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class Collator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, rows):
        enc = self.tok([r["premise"] for r in rows], [r["hypothesis"] for r in rows], truncation=True,
                       max_length=self.max_len, padding="longest", pad_to_multiple_of=8, return_tensors="pt")
        enc["labels"] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        acc[0] += (logits.argmax(-1) == labels).sum()
        acc[1] += labels.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    # same seed on every rank; rank 0 draws it when not given so reruns differ
    seed = args.seed if args.seed >= 0 else random.SystemRandom().randint(0, 2**31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(seed_t, src=0)
    seed = int(seed_t.item())

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(seed)

    # rank 0 downloads / builds the arrow cache first, the rest reuse it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "mnli")
    if rank == 0:
        dist.barrier()

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = Collator(tok, args.max_len)
    train = raw["train"]
    val = raw["validation_matched"]
    sampler = DistributedSampler(train, shuffle=True, seed=seed)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=64, collate_fn=collate,
                        num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3).to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    fwd = torch.compile(ddp, dynamic=True)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6, fused=True)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"seed {seed}, {len(train)} train ex, {total} steps, global batch {args.bs * world}", flush=True)

    step, best = 0, 0.0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    sps = 100 * args.bs * world / (time.perf_counter() - t0)
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} {sps:.0f} samples/s", flush=True)
                t0 = time.perf_counter()

            if step % args.eval_every == 0 or step == total:
                acc = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} MNLI-m acc {acc * 100:.2f}", flush=True)
                    if acc > best:
                        best = acc
                        model.save_pretrained(os.path.join(args.out, "best"), safe_serialization=True)
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()
                t0 = time.perf_counter()

    if rank == 0:
        print(f"best MNLI-m acc {best * 100:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
