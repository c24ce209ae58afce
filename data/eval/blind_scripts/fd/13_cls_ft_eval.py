"""Fine-tune an encoder on an NLI / classification task, keep the best epoch, report test accuracy.

torchrun --nproc_per_node=8 13_cls_ft_eval.py --model microsoft/deberta-v3-base \
    --task glue --subset mnli --epochs 3 --out runs/deberta_mnli
"""
import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--task", default="glue")
    ap.add_argument("--subset", default="mnli")
    ap.add_argument("--val_split", default="validation_matched")
    ap.add_argument("--test_split", default="validation_mismatched")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--out", default="runs/cls")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def tokenize(batch, tok, max_len):
    return tok(batch["premise"], batch["hypothesis"], truncation=True, max_length=max_len)


def strided(ds, rank, world):
    # exact partition, no padding, so the counts add up to len(ds)
    return Subset(ds, list(range(rank, len(ds), world)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)  # correct, total
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        stats[0] += (logits.argmax(-1) == batch["labels"]).sum()
        stats[1] += batch["labels"].numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset(args.task, args.subset)
    keep = ["input_ids", "attention_mask", "token_type_ids", "label"]
    enc = raw.map(partial(tokenize, tok=tok, max_len=args.max_len), batched=True)
    enc = enc.remove_columns([c for c in raw["train"].column_names if c not in keep])
    enc = enc.rename_column("label", "labels")
    num_labels = raw["train"].features["label"].num_classes

    collator = DataCollatorWithPadding(tok)
    train_sampler = DistributedSampler(enc["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(enc["train"], batch_size=args.bs, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(strided(enc[args.val_split], rank, world), batch_size=128,
                            collate_fn=collator, num_workers=2)
    test_loader = DataLoader(strided(enc[args.test_split], rank, world), batch_size=128,
                             collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    model = DDP(model.to(device), device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(optim, int(0.1 * total), total)
    best_path = os.path.join(args.out, "best.pt")
    best_acc = -1.0

    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.state_dict(), best_path)
                with open(os.path.join(args.out, "best.json"), "w") as f:
                    json.dump({"epoch": epoch, "val_acc": acc}, f)
        dist.barrier()

    # final test: reload the best weights into a fresh model on every rank
    del model, optim
    torch.cuda.empty_cache()
    best = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    best.load_state_dict(torch.load(best_path, map_location="cpu"))
    best.to(device)
    test_acc = evaluate(best, test_loader, device)
    if rank == 0:
        with open(os.path.join(args.out, "best.json")) as f:
            info = json.load(f)
        info["test_acc"] = test_acc
        print(json.dumps(info, indent=2))
        with open(os.path.join(args.out, "final_results.json"), "w") as f:
            json.dump(info, f, indent=2)
        tok.save_pretrained(args.out)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
