"""Subcellular localization (DeepLoc 2.0, 10 classes) by full fine-tuning of ESM-2 150M.

Sequences longer than --max_len keep the N- and C-terminal halves (targeting
signals sit at the termini). Partition 4 of the homology partitioning is used
for validation.

    torchrun --nproc_per_node=8 12_deeploc_esm_finetune.py --csv data/deeploc/Swissprot_Train_Validation_dataset.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import esm

CLASSES = ["Cytoplasm", "Nucleus", "Extracellular", "Cell membrane", "Mitochondrion",
           "Plastid", "Endoplasmic reticulum", "Lysosome/Vacuole", "Golgi apparatus", "Peroxisome"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--val_partition", type=int, default=4)
    ap.add_argument("--esm", default="esm2_t30_150M_UR50D")
    ap.add_argument("--max_len", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup_frac", type=float, default=0.05)
    ap.add_argument("--out", default="runs/deeploc")
    return ap.parse_args()


def terminal_crop(seq, max_len):
    if len(seq) <= max_len:
        return seq
    half = max_len // 2
    return seq[:half] + seq[-(max_len - half):]


class DeepLocDataset(Dataset):
    def __init__(self, df, max_len):
        self.seqs = [terminal_crop(s, max_len) for s in df["Sequence"]]
        # multi-label in the csv; train on the first listed location
        self.labels = df[CLASSES].to_numpy().argmax(1)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return str(i), self.seqs[i], int(self.labels[i])


class BatchConverterCollate:
    def __init__(self, alphabet):
        self.bc = alphabet.get_batch_converter()
        self.pad = alphabet.padding_idx

    def __call__(self, batch):
        names, seqs, labels = zip(*batch)
        _, _, tokens = self.bc(list(zip(names, seqs)))
        return tokens, torch.tensor(labels)


class LocalizationModel(nn.Module):
    def __init__(self, backbone, padding_idx, n_classes=len(CLASSES)):
        super().__init__()
        self.backbone = backbone
        self.layer = backbone.num_layers
        self.padding_idx = padding_idx
        d = backbone.embed_dim
        self.att = nn.Conv1d(d, d, 9, padding=4)
        self.val = nn.Conv1d(d, d, 9, padding=4)
        self.cls = nn.Sequential(nn.Linear(2 * d, 512), nn.ReLU(), nn.Dropout(0.25), nn.Linear(512, n_classes))

    def forward(self, tokens):
        h = self.backbone(tokens, repr_layers=[self.layer])["representations"][self.layer]
        mask = (tokens != self.padding_idx).unsqueeze(1)          # B 1 T
        x = h.transpose(1, 2)                                     # B D T
        a = self.att(x).masked_fill(~mask, -1e4).softmax(-1)
        v = self.val(x)
        pooled_att = (a * v).sum(-1)
        pooled_max = v.masked_fill(~mask, -1e4).max(-1).values
        return self.cls(torch.cat([pooled_att, pooled_max], -1))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_csv(args.csv)
    train_df = df[df["Partition"] != args.val_partition].reset_index(drop=True)
    val_df = df[df["Partition"] == args.val_partition].reset_index(drop=True)
    train_set, val_set = DeepLocDataset(train_df, args.max_len), DeepLocDataset(val_df, args.max_len)

    if rank == 0:
        esm.pretrained.load_model_and_alphabet(args.esm)
    dist.barrier()
    backbone, alphabet = esm.pretrained.load_model_and_alphabet(args.esm)
    model = LocalizationModel(backbone, alphabet.padding_idx).to(device)
    # the LM head output and the contact head are not used by the classifier
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    collate = BatchConverterCollate(alphabet)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=val_sampler, collate_fn=collate, num_workers=2)

    counts = np.bincount(train_set.labels, minlength=len(CLASSES)).astype(np.float32)
    class_w = torch.tensor(counts.sum() / (len(CLASSES) * np.maximum(counts, 1)), device=device)

    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([{"params": model.module.backbone.parameters(), "lr": args.lr},
                                   {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total = args.epochs * len(loader)
    warm = int(args.warmup_frac * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warm)) * max(0.0, (total - s) / max(1, total - warm)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i, (tokens, y) in enumerate(loader):
            tokens, y = tokens.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float(), y, weight=class_w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f}", flush=True)

        model.eval()
        confusion = torch.zeros(len(CLASSES), len(CLASSES), device=device, dtype=torch.long)
        with torch.no_grad():
            for tokens, y in val_loader:
                tokens, y = tokens.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(tokens).argmax(-1)
                confusion.index_put_((y, pred), torch.ones_like(y), accumulate=True)
        dist.all_reduce(confusion)
        cm = confusion.double()
        acc = (cm.diag().sum() / cm.sum()).item()
        tp = cm.diag()
        f1 = (2 * tp / (cm.sum(0) + cm.sum(1)).clamp(min=1)).mean().item()
        mcc_num = cm.sum() * tp.sum() - (cm.sum(0) * cm.sum(1)).sum()
        mcc_den = torch.sqrt((cm.sum() ** 2 - (cm.sum(0) ** 2).sum()) * (cm.sum() ** 2 - (cm.sum(1) ** 2).sum()))
        mcc = (mcc_num / mcc_den.clamp(min=1e-8)).item()
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val acc {acc:.4f} macro-F1 {f1:.4f} MCC {mcc:.4f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.out, "last.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
