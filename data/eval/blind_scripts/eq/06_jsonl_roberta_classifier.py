"""
Fine-tune roberta-base for review sentiment on sharded JSONL data that does not fit in RAM.

    torchrun --nproc_per_node=8 06_jsonl_roberta_classifier.py \
        --train_dir /data/reviews/train --val_dir /data/reviews/val --num_train_examples 38000000

Shards are split over (rank, dataloader worker) pairs; ranks can run out of data at
different points, so every step the ranks agree whether all of them still have a batch.
"""
import argparse
import glob
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_dir", required=True)
    p.add_argument("--val_dir", required=True)
    p.add_argument("--model_name", default="roberta-base")
    p.add_argument("--num_labels", type=int, default=5)
    p.add_argument("--num_train_examples", type=int, required=True)
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--per_device_batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--output_dir", default="/shared/models/roberta-reviews")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class JsonlShards(IterableDataset):
    def __init__(self, files, tokenizer, max_len, rank, world_size, shuffle, seed):
        self.files = sorted(files)
        self.tok = tokenizer
        self.max_len = max_len
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        n_workers = info.num_workers if info else 1
        worker_id = info.id if info else 0
        files = list(self.files)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(files)  # same permutation on all ranks
        slot = self.rank * n_workers + worker_id
        my_files = files[slot::self.world_size * n_workers]
        rng = random.Random(self.seed + self.epoch * 1000 + slot)
        buf = []
        for path in my_files:
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    buf.append((rec["text"], int(rec["label"])))
                    if len(buf) >= 64:
                        if self.shuffle:
                            rng.shuffle(buf)
                        yield from self._encode(buf)
                        buf = []
        if buf:
            yield from self._encode(buf)

    def _encode(self, pairs):
        for text, label in pairs:
            enc = self.tok(text, truncation=True, max_length=self.max_len)
            yield {"input_ids": enc["input_ids"], "label": label}


def make_collate(pad_id):
    def collate(items):
        L = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(items), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), L), dtype=torch.long)
        for i, x in enumerate(items):
            ids[i, :len(x["input_ids"])] = torch.tensor(x["input_ids"])
            mask[i, :len(x["input_ids"])] = 1
        labels = torch.tensor([x["label"] for x in items])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return collate


def all_ranks_have(has_batch: bool) -> bool:
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum()
        total += batch["labels"].numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    collate = make_collate(tok.pad_token_id)
    train_ds = JsonlShards(glob.glob(f"{args.train_dir}/*.jsonl"), tok, args.max_len,
                           rank, world_size, shuffle=True, seed=args.seed)
    val_ds = JsonlShards(glob.glob(f"{args.val_dir}/*.jsonl"), tok, args.max_len,
                         rank, world_size, shuffle=False, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=128, collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=args.num_labels).to(device)
    model = DDP(model, device_ids=[local_rank])

    steps_per_epoch = args.num_train_examples // (args.per_device_batch * world_size)
    total_steps = steps_per_epoch * args.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    step = 0
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        model.train()
        it = iter(train_loader)
        t0 = time.time()
        while True:
            batch = next(it, None)
            if not all_ranks_have(batch is not None):
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = out.loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.3f}s/it")
                    t0 = time.time()

        acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_acc {acc:.4f}")
            save_to = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.save_pretrained(save_to)
            tok.save_pretrained(save_to)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
