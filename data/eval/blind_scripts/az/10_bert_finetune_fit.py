"""Fine-tune a BERT-base classifier on an intent dataset (CLINC150 style JSON).

Originally TFBertForSequenceClassification + model.fit under MirroredStrategy;
now the PyTorch model with a small fit()/evaluate() wrapper.

    torchrun --nproc_per_node=4 10_bert_finetune_fit.py --train data/clinc_train.json --val data/clinc_val.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--model-name", default="bert-base-uncased")
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--output-dir", default="outputs/bert_intent")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class IntentDataset(Dataset):
    def __init__(self, path, tokenizer, label2id, max_len):
        with open(path) as f:
            rows = json.load(f)  # [[text, intent], ...]
        texts = [r[0] for r in rows]
        self.labels = torch.tensor([label2id[r[1]] for r in rows])
        self.enc = tokenizer(texts, max_length=max_len, padding="max_length", truncation=True,
                             return_tensors="pt")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


class SparseCategoricalAccuracy:
    def __init__(self, device):
        self.correct = torch.zeros((), device=device)
        self.total = torch.zeros((), device=device)

    def update_state(self, y_true, logits):
        self.correct += (logits.argmax(-1) == y_true).sum()
        self.total += y_true.numel()

    def result(self):
        t = torch.stack([self.correct, self.total])
        dist.all_reduce(t)
        return (t[0] / t[1]).item()

    def reset_state(self):
        self.correct.zero_()
        self.total.zero_()


class FitLoop:
    def __init__(self, model, optimizer, scheduler, device, is_chief):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.is_chief = device, is_chief
        self.acc = SparseCategoricalAccuracy(device)

    def _to(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_epoch(self, loader):
        self.model.train()
        self.acc.reset_state()
        loss_sum = torch.zeros(2, device=self.device)
        for step, batch in enumerate(loader):
            batch = self._to(batch)
            out = self.model(**batch)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            n = batch["labels"].numel()
            loss_sum += torch.stack([out.loss.detach() * n, torch.tensor(float(n), device=self.device)])
            self.acc.update_state(batch["labels"], out.logits.detach())
        dist.all_reduce(loss_sum)
        return {"loss": (loss_sum[0] / loss_sum[1]).item(), "accuracy": self.acc.result()}

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        self.acc.reset_state()
        loss_sum = torch.zeros(2, device=self.device)
        for batch in loader:
            batch = self._to(batch)
            out = self.model(**batch)
            n = batch["labels"].numel()
            loss_sum += torch.stack([out.loss * n, torch.tensor(float(n), device=self.device)])
            self.acc.update_state(batch["labels"], out.logits)
        dist.all_reduce(loss_sum)
        return {"val_loss": (loss_sum[0] / loss_sum[1]).item(), "val_accuracy": self.acc.result()}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(42)

    with open(args.train) as f:
        intents = sorted({r[1] for r in json.load(f)})
    label2id = {name: i for i, name in enumerate(intents)}
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = IntentDataset(args.train, tokenizer, label2id, args.max_len)
    val_ds = IntentDataset(args.val, tokenizer, label2id, args.max_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=128,
                            num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(intents), id2label=dict(enumerate(intents)), label2id=label2id)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{args.model_name}: {n_params / 1e6:.1f}M params, {len(intents)} intents, "
              f"{world_size} GPUs x {args.batch_size} = {world_size * args.batch_size} per step")

    loop = FitLoop(model, optimizer, scheduler, device, is_chief=(rank == 0))
    best = -math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        logs = loop.train_epoch(train_loader)
        logs.update(loop.evaluate(val_loader))
        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} ({time.time() - t0:.0f}s): "
                  + ", ".join(f"{k}={v:.4f}" for k, v in logs.items()), flush=True)
            if logs["val_accuracy"] > best:
                best = logs["val_accuracy"]
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
