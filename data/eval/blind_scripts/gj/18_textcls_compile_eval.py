"""Multi-class document classification (ModernBERT-base) with DDP + torch.compile.

Inputs are padded to one of a few bucket lengths and the sequence dim is
marked dynamic, so the train and eval graphs are each compiled once.

    torchrun --nproc_per_node=8 textcls_compile_eval.py --train data/train.parquet --val data/val.parquet \
        --num-labels 20 --out /shared/cls/modernbert_20
"""
import argparse
import logging
import os
import time

import pandas as pd
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)
BUCKETS = (64, 128, 256, 512, 1024)


class TextDataset(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path, columns=["text", "label"])
        self.texts = df["text"].tolist()
        self.labels = df["label"].astype(int).tolist()

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), truncation=True, max_length=self.max_len)
        longest = max(len(x) for x in enc["input_ids"])
        target = next(b for b in BUCKETS if b >= longest)
        enc = self.tok.pad(enc, padding="max_length", max_length=target, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(labels)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="answerdotai/ModernBERT-base")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--num-labels", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-len", type=int, default=1024)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(mask, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total, loss_sum / total


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = Collator(tokenizer, args.max_len)
    train_ds, val_ds = TextDataset(args.train), TextDataset(args.val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler, collate_fn=collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=args.num_labels).to(device)
    raw_model = model
    model = torch.compile(DDP(model, device_ids=[local_rank]))

    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    total_steps = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (ids, mask, labels) in enumerate(train_dl):
            ids, mask, labels = (t.to(device, non_blocking=True) for t in (ids, mask, labels))
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(mask, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=mask).logits
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_dl), loss.item(),
                         scheduler.get_last_lr()[0])

        val_acc, val_loss = evaluate(model, val_dl, device)
        log.info("epoch %d done in %.0fs: val_acc %.4f val_loss %.4f", epoch, time.time() - t0, val_acc, val_loss)
        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            raw_model.save_pretrained(os.path.join(args.out, "best"))
            tokenizer.save_pretrained(os.path.join(args.out, "best"))
            log.info("new best %.4f saved", best_acc)
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "best_val_acc.txt"), "w") as f:
            f.write(f"{best_acc:.5f}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
