#!/usr/bin/env python
# Fine-tune a BERT-style encoder for intent classification (tsv: label \t utterance).
#   torchrun --nproc_per_node=4 12_bert_cls_finetune_ckpt.py --model bert-base-uncased --data data/intents
import argparse
import csv
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("finetune")


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        return [(row[0], row[1]) for row in csv.reader(f, delimiter="\t") if len(row) == 2]


class IntentDataset(Dataset):
    def __init__(self, rows, label2id):
        self.rows = rows
        self.label2id = label2id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        label, text = self.rows[i]
        return text, self.label2id[label]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        stats[0] += out.loss * batch["labels"].size(0)
        stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stats[2] += batch["labels"].size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert-base-uncased")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output_dir", default="outputs/intent_bert")
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(process)d] %(message)s")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_rows = read_tsv(os.path.join(args.data, "train.tsv"))
    dev_rows = read_tsv(os.path.join(args.data, "dev.tsv"))
    test_rows = read_tsv(os.path.join(args.data, "test.tsv"))
    labels = sorted({l for l, _ in train_rows})
    label2id = {l: i for i, l in enumerate(labels)}
    dev_rows = [r for r in dev_rows if r[0] in label2id]
    test_rows = [r for r in test_rows if r[0] in label2id]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = Collator(tokenizer, args.max_len)
    train_ds = IntentDataset(train_rows, label2id)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=2, drop_last=True)

    def shard_loader(rows):
        ds = IntentDataset(rows, label2id)
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, collate_fn=collate)

    dev_loader, test_loader = shard_loader(dev_rows), shard_loader(test_rows)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(labels)).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    os.makedirs(args.output_dir, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.output_dir, "runs")) if rank == 0 else None
    best_acc, bad, step = -1.0, 0, 0
    best_path = os.path.join(args.output_dir, "best_model.pt")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        dev_loss, dev_acc = evaluate(model.module, dev_loader, device)
        if rank == 0:
            log.info(f"epoch {epoch} dev_loss {dev_loss:.4f} dev_acc {dev_acc:.4f} ({time.time() - t0:.0f}s)")
            writer.add_scalar("dev/acc", dev_acc, epoch)
        if dev_acc > best_acc:
            best_acc, bad = dev_acc, 0
            save_checkpoint(best_path, model.module, optimizer, scheduler, epoch, best_acc)
        else:
            bad += 1
            if bad >= args.patience:
                if rank == 0:
                    log.info("early stopping")
                break

    dist.barrier()
    state = torch.load(best_path, map_location=device)
    model.module.load_state_dict(state["model"])
    test_loss, test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        log.info(f"best epoch {state['epoch']} dev_acc {state['best']:.4f} test_acc {test_acc:.4f}")
        writer.add_scalar("test/acc", test_acc, 0)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
