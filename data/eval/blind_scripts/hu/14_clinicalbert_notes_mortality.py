"""Fine-tune Bio_ClinicalBERT on early ICU notes (first 48h) for in-hospital mortality.

Notes of a stay are concatenated in chart order and split into 512-token chunks; the stay-level
probability is the ClinicalBERT aggregation  P = (max_n + mean_n * n/c) / (1 + n/c).

    torchrun --nproc_per_node=8 14_clinicalbert_notes_mortality.py \
        --notes /data/mimic3/notes_first48h.parquet --labels /data/mimic3/mort_labels.csv
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

MODEL = "emilyalsentzer/Bio_ClinicalBERT"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--notes", required=True)
    p.add_argument("--labels", required=True)
    p.add_argument("--output_dir", default="out/cbert_mort")
    p.add_argument("--max_chunks", type=int, default=8)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--agg_c", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def chunk_stays(notes, labels, tok, max_chunks):
    """Returns list of (stay_id, input_ids[512], label) chunks."""
    merged = (notes.sort_values(["hadm_id", "charttime"])
              .groupby("hadm_id").text.apply(lambda s: "\n".join(s)).reset_index()
              .merge(labels, on="hadm_id"))
    chunks = []
    for row in merged.itertuples():
        ids = tok(row.text, add_special_tokens=False)["input_ids"]
        pieces = [ids[i:i + 510] for i in range(0, len(ids), 510)][-max_chunks:]
        for piece in pieces:
            chunks.append((row.hadm_id, [tok.cls_token_id] + piece + [tok.sep_token_id], int(row.mortality)))
    return chunks


class ChunkDataset(Dataset):
    def __init__(self, chunks):
        self.chunks = chunks

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, i):
        return self.chunks[i]


def make_collate(pad_id):
    def collate(batch):
        L = max(len(c[1]) for c in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        for j, (_, c, _) in enumerate(batch):
            ids[j, : len(c)] = torch.tensor(c)
        return {
            "stay": torch.tensor([b[0] for b in batch]),
            "input_ids": ids,
            "attention_mask": (ids != pad_id).long(),
            "labels": torch.tensor([b[2] for b in batch]),
        }
    return collate


def aggregate(stays, probs, labels, c):
    df = pd.DataFrame({"stay": stays, "p": probs, "y": labels})
    g = df.groupby("stay")
    n = g.p.size()
    score = (g.p.max() + g.p.mean() * n / c) / (1 + n / c)
    return g.y.first().values, score.values


@torch.no_grad()
def evaluate(model, chunks, collate, device, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = chunks[rank::world]
    loader = DataLoader(ChunkDataset(shard), batch_size=64, collate_fn=collate, num_workers=2)
    model.eval()
    stays, probs, ys = [], [], []
    for b in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
        probs.append(torch.softmax(logits.float(), -1)[:, 1])
        stays.append(b["stay"].to(device))
        ys.append(b["labels"].to(device))
    local = torch.stack([torch.cat(stays).float(), torch.cat(probs), torch.cat(ys).float()])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered, dim=1).cpu().numpy()
    y, s = aggregate(allv[0].astype(np.int64), allv[1], allv[2], args.agg_c)
    return roc_auc_score(y, s), average_precision_score(y, s)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(MODEL)
    notes = pd.read_parquet(args.notes)
    labels = pd.read_csv(args.labels)  # hadm_id, subject_id, split, mortality
    parts = {s: chunk_stays(notes[notes.hadm_id.isin(labels[labels.split == s].hadm_id)],
                            labels[labels.split == s][["hadm_id", "mortality"]], tok, args.max_chunks)
             for s in ("train", "val")}
    if rank == 0:
        print({k: len(v) for k, v in parts.items()}, "chunks", flush=True)

    collate = make_collate(tok.pad_token_id)
    train_ds = ChunkDataset(parts["train"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=2).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, b in enumerate(loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items() if k != "stay"}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**b).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        auroc, auprc = evaluate(model.module, parts["val"], collate, device, args)
        if rank == 0:
            print(f"epoch {epoch}: stay-level val AUROC {auroc:.4f} AUPRC {auprc:.4f}", flush=True)
            if auroc > best:
                best = auroc
                model.module.save_pretrained(args.output_dir)
                tok.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
