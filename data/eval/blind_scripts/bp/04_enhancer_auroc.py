"""Fine-tune DNABERT-2 on active-enhancer classification (STARR-seq derived labels).

Input: parquet files with columns `sequence` (ACGT, 500-2000 bp) and `label` (0/1).
Model selection on validation AUROC; the best model is kept in --output_dir/best.

    torchrun --nproc_per_node=4 04_enhancer_auroc.py --train data/train.parquet \
        --valid data/valid.parquet --output_dir runs/enh_dnabert2
"""
import argparse
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("enhancer")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="zhihan1996/DNABERT-2-117M")
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_length", type=int, default=512, help="BPE tokens")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class SeqDataset(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path, columns=["sequence", "label"])
        self.seqs = df["sequence"].str.upper().tolist()
        self.labels = df["label"].astype(np.int64).to_numpy()

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.labels[i]


class Collate:
    def __init__(self, tokenizer, max_length):
        self.tok = tokenizer
        self.max_length = max_length

    def __call__(self, batch):
        seqs, labels = zip(*batch)
        enc = self.tok(list(seqs), padding="longest", truncation=True, max_length=self.max_length,
                       return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


@torch.no_grad()
def run_validation(model, loader, device):
    model.eval()
    scores, labels = [], []
    for batch in loader:
        y = batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        scores.append(F.softmax(logits.float(), dim=-1)[:, 1].cpu())
        labels.append(y)
    model.train()
    s = torch.cat(scores).numpy()
    y = torch.cat(labels).numpy()
    return roc_auc_score(y, s), average_precision_score(y, s)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    train_ds, valid_ds = SeqDataset(args.train), SeqDataset(args.valid)
    collate = Collate(tokenizer, args.max_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=2 * args.batch_size, sampler=valid_sampler,
                              collate_fn=collate, num_workers=4)
    logger.info("train %d valid %d (pos frac %.3f)", len(train_ds), len(valid_ds), train_ds.labels.mean())

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2,
                                                               trust_remote_code=True).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    pos_weight = torch.tensor([1.0, float((1 - train_ds.labels.mean()) / train_ds.labels.mean())],
                              device=device)
    best_auroc, step = 0.0, 0
    best_dir = os.path.join(args.output_dir, "best")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), labels, weight=pos_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.eval_every == 0:
                auroc, auprc = run_validation(model, valid_loader, device)
                if rank == 0:
                    logger.info("epoch %d step %d loss %.4f | valid AUROC %.4f AUPRC %.4f",
                                epoch, step, loss.item(), auroc, auprc)
                    if auroc > best_auroc:
                        best_auroc = auroc
                        model.module.save_pretrained(best_dir)
                        tokenizer.save_pretrained(best_dir)
                        logger.info("new best AUROC %.4f saved to %s", auroc, best_dir)
                dist.barrier()

    auroc, auprc = run_validation(model, valid_loader, device)
    if rank == 0:
        logger.info("final valid AUROC %.4f AUPRC %.4f (best %.4f)", auroc, auprc, best_auroc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
