"""Fine-tune a BERT encoder on SST-2 with a small classification head.

Used to run with apex.amp (O1) + apex.parallel.DistributedDataParallel and
`python -m torch.distributed.launch --use_env`; now torch.amp + torch DDP
under torchrun.
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger("sst2")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bert-base-uncased")
    p.add_argument("--output_dir", default="runs/sst2")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--per_gpu_batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5, help="peak LR for the global batch of 256")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class SentenceClassifier(nn.Module):
    def __init__(self, name, num_labels, dropout):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_labels))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids)
        cls = out.last_hidden_state[:, 0]
        return self.head(self.dropout(cls))


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_data(args, tokenizer, rank, world_size):
    raw = load_dataset("glue", "sst2")

    def tok(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=args.max_len)

    # let rank 0 fill the datasets cache first, the others then reuse it
    if rank != 0:
        dist.barrier()
    enc = raw.map(tok, batched=True, remove_columns=["sentence", "idx"])
    if rank == 0:
        dist.barrier()
    enc = enc.rename_column("label", "labels")
    enc.set_format("torch")

    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(enc["train"], num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(enc["validation"], num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(enc["train"], batch_size=args.per_gpu_batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(enc["validation"], batch_size=64, sampler=val_sampler,
                            collate_fn=collate, num_workers=2, pin_memory=True)
    return train_loader, train_sampler, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch)
        stats[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        stats[1] += (logits.argmax(-1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_loader, train_sampler, val_loader = build_data(args, tokenizer, rank, world_size)

    model = SentenceClassifier(args.model_name, num_labels=2, dropout=args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    global_batch = args.per_gpu_batch_size * world_size
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.AdamW(params, lr=lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    logger.info("world_size=%d global_batch=%d lr=%.2e steps=%d", world_size, global_batch, lr, total_steps)
    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                logits = model(**batch)
                loss = F.cross_entropy(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0])

        val_loss, val_acc = evaluate(model, val_loader, device)
        logger.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
            with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
