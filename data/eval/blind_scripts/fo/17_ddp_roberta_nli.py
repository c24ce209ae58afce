"""RoBERTa-large + custom classification head on MNLI/SNLI/ANLI combined.
DDP, fp16 autocast + GradScaler, gradient accumulation with no_sync, dataset cache
built once on rank 0, wandb on rank 0.

torchrun --nproc_per_node=8 17_ddp_roberta_nli.py --output_dir runs/roberta_nli --grad_accum 4
"""
import argparse
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from datasets import concatenate_datasets, load_dataset, load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="roberta-large")
    ap.add_argument("--cache_dir", default="/shared/cache/nli_tok")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--wandb_project", default="nli")
    return ap.parse_args()


class NLIClassifier(nn.Module):
    def __init__(self, backbone, num_labels=3):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(backbone)  # keeps its pooler; we do not use it
        h = self.encoder.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h), nn.Tanh(), nn.Dropout(0.1), nn.Linear(h, num_labels))

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, 0])


def build_dataset(tokenizer, args, rank):
    """Tokenize once on rank 0 and save to shared storage; other ranks wait, then load."""
    if rank == 0 and not os.path.isdir(args.cache_dir):
        mnli = load_dataset("multi_nli")
        snli = load_dataset("snli").filter(lambda ex: ex["label"] != -1)
        train = concatenate_datasets([mnli["train"], snli["train"]]).select_columns(["premise", "hypothesis", "label"])
        val = mnli["validation_matched"].select_columns(["premise", "hypothesis", "label"])

        def tok(batch):
            return tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=args.max_len)

        train = train.map(tok, batched=True, num_proc=16, remove_columns=["premise", "hypothesis"])
        val = val.map(tok, batched=True, remove_columns=["premise", "hypothesis"])
        train.save_to_disk(os.path.join(args.cache_dir + ".tmp", "train"))
        val.save_to_disk(os.path.join(args.cache_dir + ".tmp", "val"))
        os.rename(args.cache_dir + ".tmp", args.cache_dir)
    dist.barrier()
    train = load_from_disk(os.path.join(args.cache_dir, "train")).rename_column("label", "labels")
    val = load_from_disk(os.path.join(args.cache_dir, "val")).rename_column("label", "labels")
    return train.with_format("torch"), val.with_format("torch")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, dtype=torch.long, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(batch["input_ids"], batch["attention_mask"])
        c[0] += (logits.argmax(-1) == batch["labels"]).sum()
        c[1] += batch["labels"].numel()
    dist.all_reduce(c)
    model.train()
    return c[0].item() / c[1].item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # first run: rank 0 tokenizes ~1M pairs while the others sit in the barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    if is_main:
        wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.output_dir))

    tokenizer = AutoTokenizer.from_pretrained(args.backbone)
    train_ds, val_ds = build_dataset(tokenizer, args, rank)
    val_ds = val_ds.shard(num_shards=world, index=rank, contiguous=True)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, collate_fn=collator, num_workers=2)

    model = NLIClassifier(args.backbone).to(device)
    # pooler output is computed by the encoder but never reaches the loss
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_updates = args.epochs * (len(train_loader) // args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup * n_updates), n_updates)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = nn.CrossEntropyLoss()

    best, update = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        usable = (len(train_loader) // args.grad_accum) * args.grad_accum
        for i, batch in enumerate(train_loader):
            if i >= usable:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (i + 1) % args.grad_accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(batch["input_ids"], batch["attention_mask"])
                    loss = loss_fn(logits.float(), batch["labels"])
                scaler.scale(loss / args.grad_accum).backward()
            if not sync:
                continue
            scaler.unscale_(optimizer)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            stepped = scaler.get_scale() >= scale  # identical on all ranks: grads were all-reduced
            if stepped:
                scheduler.step()
            update += 1
            if is_main and update % 50 == 0:
                wandb.log({"loss": loss.item(), "grad_norm": gnorm.item(), "lr": scheduler.get_last_lr()[0],
                           "loss_scale": scaler.get_scale(), "epoch": epoch}, step=update)

        acc = evaluate(model.module, val_loader, device)
        if is_main:
            wandb.log({"val/acc_matched": acc}, step=update)
            print(f"epoch {epoch}: mnli-m acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.output_dir, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
