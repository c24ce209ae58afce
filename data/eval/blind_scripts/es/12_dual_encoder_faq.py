"""Dual-encoder for FAQ retrieval: question -> answer passage, in-batch negatives gathered
from every GPU.

pairs.jsonl lines: {"query": ..., "passage": ...}

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 12_dual_encoder_faq.py \
        --train_file data/faq_pairs_train.jsonl --dev_file data/faq_pairs_dev.jsonl
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


class PairDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]["query"], self.rows[i]["passage"]


class Collator:
    def __init__(self, tokenizer, q_len, p_len):
        self.tok, self.q_len, self.p_len = tokenizer, q_len, p_len

    def __call__(self, batch):
        queries, passages = zip(*batch)
        q = self.tok(list(queries), max_length=self.q_len, truncation=True, padding=True, return_tensors="pt")
        p = self.tok(list(passages), max_length=self.p_len, truncation=True, padding=True, return_tensors="pt")
        return {"q_ids": q["input_ids"], "q_mask": q["attention_mask"],
                "p_ids": p["input_ids"], "p_mask": p["attention_mask"]}


def mean_pool(model, ids, mask):
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-6), dim=-1)


def gather_keep_grad(accelerator, local):
    """All-gather embeddings; this rank's slice keeps its autograd graph."""
    gathered = accelerator.gather(local.detach().contiguous())
    chunks = list(gathered.split(local.size(0), dim=0))
    chunks[accelerator.process_index] = local
    return torch.cat(chunks, dim=0)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--dev_file", required=True)
    ap.add_argument("--model_name", default="intfloat/e5-base-v2")
    ap.add_argument("--output_dir", default="runs/faq_dual_encoder")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--q_len", type=int, default=64)
    ap.add_argument("--p_len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.02)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, accelerator):
    model.eval()
    q_all, p_all = [], []
    for batch in loader:
        q = mean_pool(model, batch["q_ids"], batch["q_mask"])
        p = mean_pool(model, batch["p_ids"], batch["p_mask"])
        q, p = accelerator.gather_for_metrics((q, p))
        q_all.append(q.float())
        p_all.append(p.float())
    q_all, p_all = torch.cat(q_all), torch.cat(p_all)
    # every rank holds the full, de-duplicated dev set after gather_for_metrics
    ranks = (q_all @ p_all.T).argsort(dim=1, descending=True)
    gold = torch.arange(q_all.size(0), device=q_all.device).unsqueeze(1)
    pos = (ranks == gold).float().argmax(dim=1)
    model.train()
    return {"mrr@10": torch.where(pos < 10, 1.0 / (pos + 1).float(), torch.zeros_like(pos, dtype=torch.float)).mean().item(),
            "r@1": (pos < 1).float().mean().item(), "r@10": (pos < 10).float().mean().item()}


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModel.from_pretrained(args.model_name)
    collate = Collator(tokenizer, args.q_len, args.p_len)

    train_ds, dev_ds = PairDataset(args.train_file), PairDataset(args.dev_file)
    # drop_last keeps every rank's batch the same size, so gathered slices line up
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                              num_workers=4, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=128, collate_fn=collate, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    model, optimizer, train_loader, dev_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, dev_loader, scheduler
    )

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.print(f"world={accelerator.num_processes} effective negatives per query="
                      f"{args.batch_size * accelerator.num_processes - 1}")

    best, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros((), device=accelerator.device)
        for step, batch in enumerate(train_loader):
            q = mean_pool(model, batch["q_ids"], batch["q_mask"])
            p = mean_pool(model, batch["p_ids"], batch["p_mask"])
            p_global = gather_keep_grad(accelerator, p)
            scores = q @ p_global.T / args.temperature
            targets = torch.arange(q.size(0), device=q.device) + accelerator.process_index * q.size(0)
            loss = F.cross_entropy(scores.float(), targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            running += loss.detach()
            if (step + 1) % 100 == 0:
                avg = accelerator.reduce(running, reduction="mean") / 100
                running.zero_()
                accelerator.print(f"epoch {epoch} step {step + 1} loss {avg.item():.4f}")

        metrics = evaluate(model, dev_loader, accelerator)
        accelerator.print(f"epoch {epoch} dev {metrics}")

        # metrics are identical on all ranks, but let rank 0 decide and tell the others
        if accelerator.is_main_process:
            if metrics["mrr@10"] > best:
                best, bad_epochs = metrics["mrr@10"], 0
            else:
                bad_epochs += 1
            if bad_epochs >= args.patience:
                accelerator.set_trigger()
        improved = torch.tensor([1.0 if bad_epochs == 0 else 0.0], device=accelerator.device)
        dist.broadcast(improved, src=0)

        accelerator.wait_for_everyone()
        if improved.item() > 0:
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        if accelerator.check_trigger():
            accelerator.print(f"no improvement for {args.patience} epochs, stopping at epoch {epoch}")
            break

    accelerator.end_training()


if __name__ == "__main__":
    main()
