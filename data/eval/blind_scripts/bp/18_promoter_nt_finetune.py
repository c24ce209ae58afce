"""Promoter detection (EPDnew human TATA + non-TATA vs. shuffled negatives, 300 bp)
by fine-tuning Nucleotide Transformer v2 with a classification head.

    torchrun --nproc_per_node=4 18_promoter_nt_finetune.py --data_dir data/promoter_all \
        --output_dir runs/promoter_nt50m
"""
import argparse
import csv
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score, matthews_corrcoef
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="NT promoter fine-tuning")
    parser.add_argument("--model_name", default="InstaDeepAI/nucleotide-transformer-v2-50m-multi-species")
    parser.add_argument("--data_dir", required=True, help="train.csv / dev.csv / test.csv with sequence,label")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=64, help="6-mer tokens; 300 bp -> 50 + special")
    parser.add_argument("--per_device_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--num_epochs", type=int, default=10)
    parser.add_argument("--warmup_ratio", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CsvSeqs(Dataset):
    def __init__(self, path):
        with open(path) as fh:
            rows = list(csv.DictReader(fh))
        self.seqs = [r["sequence"] for r in rows]
        self.labels = [int(r["label"]) for r in rows]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.labels[i]


def build_collate(tokenizer, max_length):
    def _collate(batch):
        seqs, labels = zip(*batch)
        enc = tokenizer(list(seqs), padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc
    return _collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds.append(logits.argmax(-1))
        labels.append(batch["labels"])
    preds, labels = torch.cat(preds), torch.cat(labels)
    world = dist.get_world_size()
    all_p = [torch.empty_like(preds) for _ in range(world)]
    all_l = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(all_p, preds)
    dist.all_gather(all_l, labels)
    model.train()
    # samples were dealt round-robin by the sampler: interleave back and drop the padding
    p = torch.stack(all_p, 1).flatten().cpu().numpy()[: len(loader.dataset)]
    l = torch.stack(all_l, 1).flatten().cpu().numpy()[: len(loader.dataset)]
    return matthews_corrcoef(l, p), f1_score(l, p, average="macro")


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name, trust_remote_code=True)
    collate = build_collate(tokenizer, args.max_length)
    train_ds = CsvSeqs(os.path.join(args.data_dir, "train.csv"))
    dev_ds = CsvSeqs(os.path.join(args.data_dir, "dev.csv"))
    test_ds = CsvSeqs(os.path.join(args.data_dir, "test.csv"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=256, sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=2,
                                                               trust_remote_code=True)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    num_steps = args.num_epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * num_steps), num_steps)

    best_mcc = -1.0
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            running += out.loss.item()
            if (step + 1) % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step + 1, running / 100)
                running = 0.0
        mcc, f1 = evaluate(model, dev_loader, device)
        log.info("epoch %d dev MCC %.4f F1 %.4f", epoch, mcc, f1)
        if mcc > best_mcc:
            best_mcc = mcc
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    mcc, f1 = evaluate(model, test_loader, device)
    log.info("test MCC %.4f F1 %.4f (last epoch; best dev MCC %.4f)", mcc, f1, best_mcc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
