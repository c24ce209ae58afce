"""
IMDB sentiment with DistilBERT, plain PyTorch DDP (no Trainer).

torchrun --nproc_per_node=4 15_imdb_distilbert_ddp.py --epochs 2 --bs 32
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def ddp_setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device):
    """Accuracy over the whole test split (the loader is sharded by DistributedSampler)."""
    model.eval()
    correct = torch.tensor(0, device=device)
    count = torch.tensor(0, device=device)
    loss_sum = torch.tensor(0.0, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        loss_sum += out.loss * batch["labels"].size(0)
        correct += (out.logits.argmax(-1) == batch["labels"]).sum()
        count += batch["labels"].size(0)
    for t in (correct, count, loss_sum):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    model.train()
    return correct.item() / count.item(), loss_sum.item() / count.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="distilbert-base-uncased")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bs", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--out", default="ckpt/imdb")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    local_rank, rank, world_size = ddp_setup()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # datasets' own cache is safe to share; rank 0 builds it first, the others reuse it
    if rank != 0:
        dist.barrier()
    ds = load_dataset("imdb")
    ds = ds.map(lambda b: tokenizer(b["text"], truncation=True, max_length=args.max_len,
                                    padding="max_length"),
                batched=True, remove_columns=["text"])
    if rank == 0:
        dist.barrier()
    ds = ds.rename_column("label", "labels")
    ds.set_format("torch", columns=["input_ids", "attention_mask", "labels"])

    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(ds["test"], shuffle=False)
    train_loader = DataLoader(ds["train"], batch_size=args.bs, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(ds["test"], batch_size=128, sampler=test_sampler,
                             num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, best_acc = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}")

            if step % args.eval_every == 0 and rank == 0:
                acc, val_loss = evaluate(model, test_loader, device)
                print(f"[eval] step {step} acc {acc:.4f} loss {val_loss:.4f}")
                if acc > best_acc:
                    best_acc = acc
                    model.module.save_pretrained(args.out)
                    tokenizer.save_pretrained(args.out)

    if rank == 0:
        print(f"done, best acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
