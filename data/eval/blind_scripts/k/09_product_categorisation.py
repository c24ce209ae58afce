"""Product taxonomy classifier (title + description -> leaf category) fine-tuned from a multilingual encoder.

Preemptible k8s nodes, so the job resumes from the latest checkpoint on restart.
    torchrun --nnodes=1 --nproc_per_node=8 --max_restarts=3 09_product_categorisation.py \
        --train data/catalog_train.parquet --valid data/catalog_valid.parquet --out /ckpt/taxonomy
"""
import argparse
import glob
import logging
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("taxonomy")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="xlm-roberta-base")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--save_every", type=int, default=2000)
    return p.parse_args()


class CatalogDataset(Dataset):
    def __init__(self, path, label_map=None):
        df = pd.read_parquet(path, columns=["title", "description", "leaf_category"])
        self.text = (df["title"].fillna("") + " | " + df["description"].fillna("").str.slice(0, 400)).tolist()
        self.label_map = label_map or {c: i for i, c in enumerate(sorted(df["leaf_category"].unique()))}
        self.labels = df["leaf_category"].map(self.label_map).fillna(-100).astype(int).tolist()

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return self.text[i], self.labels[i]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


class CheckpointManager:
    def __init__(self, out_dir, rank):
        self.out_dir, self.rank = out_dir, rank

    def save(self, model, optimizer, scheduler, epoch, step):
        if self.rank != 0:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"ckpt_e{epoch}_s{step:07d}.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        logger.info("saved %s", path)

    def latest(self):
        files = sorted(glob.glob(os.path.join(self.out_dir, "ckpt_e*_s*.pt")))
        return files[-1] if files else None


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        valid = batch["labels"] != -100
        correct[0] += (logits.argmax(-1)[valid] == batch["labels"][valid]).sum()
        correct[1] += valid.sum()
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = CatalogDataset(args.train)
    valid_ds = CatalogDataset(args.valid, label_map=train_ds.label_map)
    collate = Collator(tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.bs * 2, collate_fn=collate, num_workers=4,
                              sampler=DistributedSampler(valid_ds, shuffle=False))

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(train_ds.label_map))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total_steps), total_steps)

    ckpt = CheckpointManager(args.out, rank)
    start_epoch, start_step = 0, 0
    latest = ckpt.latest()
    if latest is not None:
        state = torch.load(latest, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, start_step = state["epoch"], state["step"]
        logger.info("resuming from %s", latest)

    model = DDP(model, device_ids=[local_rank])

    global_step = start_step
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        skip = global_step - epoch * len(train_loader)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                logger.info("ep %d step %d loss %.4f (%.1f it/s)", epoch, global_step, loss.item(),
                            100 / (time.time() - t0))
                t0 = time.time()
            if global_step % args.save_every == 0:
                ckpt.save(model, optimizer, scheduler, epoch, global_step)
        acc = evaluate(model, valid_loader, device)
        if rank == 0:
            logger.info("epoch %d valid acc %.4f", epoch, acc)
        ckpt.save(model, optimizer, scheduler, epoch + 1, global_step)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
