"""30-day readmission prediction from visit sequences (GRU over admissions).

Input is the pickled cohort produced by `build_cohort.py`: one record per patient
with the list of prior admissions (code ids per admission, days since previous
admission) and the 30-day readmission label for the index admission.

Launch:
    torchrun --nproc_per_node=4 train_readmission_gru.py --data /data/ehr/readmit_cohort.pkl
"""
import argparse
import json
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("readmit")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out_dir", default="runs/readmit_gru")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=1e-5)
    p.add_argument("--emb_dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--max_visits", type=int, default=50)
    p.add_argument("--max_codes", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


class VisitSequenceDataset(Dataset):
    def __init__(self, records, max_visits, max_codes):
        self.records = records
        self.max_visits = max_visits
        self.max_codes = max_codes

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        r = self.records[idx]
        visits = r["visits"][-self.max_visits:]
        deltas = r["deltas"][-self.max_visits:]
        codes = np.zeros((len(visits), self.max_codes), dtype=np.int64)
        for i, v in enumerate(visits):
            v = v[: self.max_codes]
            codes[i, : len(v)] = v
        return {
            "codes": torch.from_numpy(codes),
            "deltas": torch.tensor(deltas, dtype=torch.float32),
            "label": torch.tensor(r["label"], dtype=torch.float32),
        }


def collate(batch):
    lengths = torch.tensor([b["codes"].shape[0] for b in batch])
    T = int(lengths.max())
    C = batch[0]["codes"].shape[1]
    codes = torch.zeros(len(batch), T, C, dtype=torch.long)
    deltas = torch.zeros(len(batch), T)
    for i, b in enumerate(batch):
        n = b["codes"].shape[0]
        codes[i, :n] = b["codes"]
        deltas[i, :n] = b["deltas"]
    labels = torch.stack([b["label"] for b in batch])
    return codes, deltas, lengths, labels


class ReadmissionGRU(nn.Module):
    def __init__(self, vocab_size, emb_dim, hidden, dropout=0.2):
        super().__init__()
        self.code_emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.time_proj = nn.Linear(1, emb_dim)
        self.gru = nn.GRU(emb_dim, hidden, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, 1)

    def forward(self, codes, deltas, lengths):
        # sum code embeddings within each visit
        mask = (codes > 0).unsqueeze(-1).float()
        v = (self.code_emb(codes) * mask).sum(2)
        v = v + self.time_proj(torch.log1p(deltas).unsqueeze(-1))
        packed = pack_padded_sequence(v, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(self.drop(h[-1])).squeeze(-1)


def train_one_epoch(model, loader, optimizer, device, epoch):
    model.train()
    total, n = 0.0, 0
    for step, (codes, deltas, lengths, labels) in enumerate(loader):
        codes, deltas, labels = codes.to(device), deltas.to(device), labels.to(device)
        logits = model(codes, deltas, lengths)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        total += loss.item() * labels.size(0)
        n += labels.size(0)
    stats = torch.tensor([total, n], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, ys = [], []
    for codes, deltas, lengths, labels in loader:
        logits = model(codes.to(device), deltas.to(device), lengths)
        probs.append(torch.sigmoid(logits).cpu())
        ys.append(labels)
    probs = torch.cat(probs).numpy()
    ys = torch.cat(ys).numpy()
    return {
        "auroc": float(roc_auc_score(ys, probs)),
        "auprc": float(average_precision_score(ys, probs)),
    }


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    with open(args.data, "rb") as f:
        cohort = pickle.load(f)
    vocab_size = cohort["vocab_size"]
    train_set = VisitSequenceDataset(cohort["train"], args.max_visits, args.max_codes)
    val_set = VisitSequenceDataset(cohort["val"], args.max_visits, args.max_codes)
    logger.info("train=%d val=%d vocab=%d world=%d", len(train_set), len(val_set), vocab_size, world_size)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.num_workers, collate_fn=collate, pin_memory=True)

    model = ReadmissionGRU(vocab_size, args.emb_dim, args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    os.makedirs(args.out_dir, exist_ok=True)
    best_auroc = -1.0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_one_epoch(model, train_loader, optimizer, device, epoch)
        scheduler.step()
        metrics = evaluate(model, val_loader, device)
        if rank == 0:
            logger.info("epoch %d loss %.4f val_auroc %.4f val_auprc %.4f (%.0fs)",
                        epoch, train_loss, metrics["auroc"], metrics["auprc"], time.time() - t0)
            history.append({"epoch": epoch, "train_loss": train_loss, **metrics})
            if metrics["auroc"] > best_auroc:
                best_auroc = metrics["auroc"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        logger.info("best val AUROC %.4f", best_auroc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
