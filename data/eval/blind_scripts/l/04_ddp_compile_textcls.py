"""DeBERTa-v3 sentiment fine-tune, DDP + torch.compile + bf16 autocast.

torchrun --standalone --nproc_per_node=4 04_ddp_compile_textcls.py \
    --model microsoft/deberta-v3-base --epochs 3 --out ckpt/deberta_imdb
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--bs", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="ckpt/textcls")
    ap.add_argument("--no_compile", action="store_true")
    return ap.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), dist.get_world_size(), local_rank


def log0(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def load_data(args, tok, rank):
    # rank 0 tokenizes and fills the datasets cache, the others read it afterwards
    if rank != 0:
        dist.barrier()
    raw = load_dataset("stanfordnlp/imdb")
    enc = raw.map(
        lambda b: tok(b["text"], truncation=True, max_length=args.max_len, padding="max_length"),
        batched=True,
        remove_columns=["text"],
        num_proc=8,
    )
    if rank == 0:
        dist.barrier()
    enc = enc.rename_column("label", "labels")
    enc.set_format("torch", columns=["input_ids", "attention_mask", "labels"])
    return enc["train"], enc["test"]


@torch.no_grad()
def evaluate(model, ds, rank, world, device, bs):
    # strided shard without padding, so every example is counted exactly once
    shard = Subset(ds, list(range(rank, len(ds), world)))
    loader = DataLoader(shard, batch_size=bs * 2, num_workers=2, pin_memory=True)
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        totals[0] += loss
        totals[1] += (logits.argmax(-1) == batch["labels"]).sum()
        totals[2] += batch["labels"].numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parse()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, test_ds = load_data(args, tok, rank)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    base = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    ddp_model = DDP(base, device_ids=[local_rank])
    train_model = ddp_model if args.no_compile else torch.compile(ddp_model)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in base.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in base.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=args.lr, fused=True)
    total_steps = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(args.warmup * total_steps), total_steps)

    log0(f"world={world} per_gpu_bs={args.bs} steps/epoch={len(loader)}")
    best_acc = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run_loss = torch.zeros((), device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = train_model(input_ids=batch["input_ids"],
                                  attention_mask=batch["attention_mask"])
            loss = F.cross_entropy(out.logits.float(), batch["labels"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            run_loss += loss.detach()
            step += 1
            if step % 50 == 0:
                dist.all_reduce(run_loss, op=dist.ReduceOp.AVG)
                log0(f"ep {epoch} step {step} loss {run_loss.item() / 50:.4f} "
                     f"lr {sched.get_last_lr()[0]:.2e}")
                run_loss.zero_()

        val_loss, val_acc = evaluate(base, test_ds, rank, world, device, args.bs)
        log0(f"epoch {epoch} done in {time.time() - t0:.0f}s  val_loss {val_loss:.4f} "
             f"val_acc {val_acc:.4f}")

        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": base.state_dict(), "epoch": epoch, "val_acc": val_acc},
                       os.path.join(args.out, "best.pt"))
            tok.save_pretrained(args.out)
            with open(os.path.join(args.out, "metrics.json"), "w") as f:
                json.dump({"epoch": epoch, "val_acc": val_acc, "val_loss": val_loss}, f)
        dist.barrier()

    log0(f"best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
