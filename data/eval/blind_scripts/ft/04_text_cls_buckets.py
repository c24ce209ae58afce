"""Fine-tune a RoBERTa classifier on long, very unevenly sized documents.

Documents are tokenized once, sorted into length buckets and batched under a
token budget, so short reviews go in big batches and long ones in small batches.

torchrun --standalone --nproc_per_node=4 04_text_cls_buckets.py \
    --train data/reviews_train.jsonl --dev data/reviews_dev.jsonl --output-dir out/roberta_reviews
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--model-name", default="roberta-base")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per GPU batch incl. padding")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ReviewDataset(Dataset):
    def __init__(self, path, tokenizer, label2id, max_length):
        self.input_ids, self.labels = [], []
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=max_length)
        self.input_ids = enc["input_ids"]
        self.labels = [label2id[r["label"]] for r in rows]
        self.lengths = np.array([len(x) for x in self.input_ids])

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, idx):
        return self.input_ids[idx], self.labels[idx]


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        max_len = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), max_len), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention_mask[i, : len(ids)] = 1
        labels = torch.tensor([y for _, y in batch])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class BucketBatchSampler(Sampler):
    """Length-sorted token-budget batches; the batch order is shuffled every epoch and
    the batch list is dealt round-robin over the ranks."""

    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, drop_uneven=True):
        order = np.argsort(lengths, kind="stable")
        self.batches, cur, cur_max = [], [], 0
        for idx in order:
            cur_max_new = max(cur_max, lengths[idx])
            if cur and cur_max_new * (len(cur) + 1) > max_tokens:
                self.batches.append(cur)
                cur, cur_max_new = [], lengths[idx]
            cur.append(int(idx))
            cur_max = cur_max_new
        if cur:
            self.batches.append(cur)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.drop_uneven = drop_uneven

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = self.batches
        if self.shuffle:
            rng = np.random.default_rng(self.seed + self.epoch)
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.drop_uneven:
            batches = batches[: len(batches) - len(batches) % self.num_replicas]
        return iter(batches[self.rank::self.num_replicas])

    def __len__(self):
        n = len(self.batches)
        if self.drop_uneven:
            return n // self.num_replicas
        return len(range(self.rank, n, self.num_replicas))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device)  # loss_sum, correct, total
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        counts[0] += out.loss * batch["labels"].numel()
        counts[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        counts[2] += batch["labels"].numel()
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    seed = args.seed + rank
    seed_everything(seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    with open(args.train) as f:
        label_names = sorted({json.loads(line)["label"] for line in f})
    label2id = {name: i for i, name in enumerate(label_names)}

    train_ds = ReviewDataset(args.train, tokenizer, label2id, args.max_length)
    dev_ds = ReviewDataset(args.dev, tokenizer, label2id, args.max_length)
    collator = PadCollator(tokenizer.pad_token_id)
    train_sampler = BucketBatchSampler(train_ds.lengths, args.max_tokens, world_size, rank, shuffle=True, seed=seed)
    dev_sampler = BucketBatchSampler(dev_ds.lengths, args.max_tokens, world_size, rank, shuffle=False,
                                     drop_uneven=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collator, num_workers=2)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label_names),
        id2label=dict(enumerate(label_names)), label2id=label2id).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    best_acc = 0.0
    global_step = 0
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
            global_step += 1
            if is_main and global_step % 50 == 0:
                print(f"epoch {epoch} step {global_step}/{total_steps} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        dev_loss, dev_acc = evaluate(model.module, dev_loader, device)
        if is_main:
            print(f"== epoch {epoch}: dev loss {dev_loss:.4f} acc {dev_acc:.4f}", flush=True)
            if dev_acc > best_acc:
                best_acc = dev_acc
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
