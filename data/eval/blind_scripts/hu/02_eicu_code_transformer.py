# In-hospital mortality from the first 24h of ICU events, pooled over all eICU hospitals.
#
#   torchrun --standalone --nproc_per_node=8 02_eicu_code_transformer.py \
#       --events /datasets/eicu/derived/first24h_events.parquet \
#       --splits /datasets/eicu/derived/patient_splits.csv
#
# events: one row per (patientunitstayid, offset_min, code); code is a string like
#   "dx:518.81", "med:vancomycin", "lab:lactate:high"
# splits: patientunitstayid, uniquepid, hospitalid, split, mortality
import argparse
import json
import os
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score, average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAD, UNK = 0, 1


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--splits", required=True)
    ap.add_argument("--output", default="checkpoints/eicu_mort")
    ap.add_argument("--min_count", type=int, default=20)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--d_model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--warmup_steps", type=int, default=500)
    return ap.parse_args()


def build_vocab(seqs, min_count):
    counts = Counter(code for seq in seqs for _, code in seq)
    kept = {c for c, n in counts.items() if n >= min_count}
    itos = ["[PAD]", "[UNK]"] + list(kept)
    return {c: i for i, c in enumerate(itos)}


def load_cohort(events_path, splits_path):
    splits = pd.read_csv(splits_path)
    ev = pd.read_parquet(events_path, columns=["patientunitstayid", "offset_min", "code"])
    ev = ev[(ev.offset_min >= 0) & (ev.offset_min < 24 * 60)]
    ev = ev.sort_values(["patientunitstayid", "offset_min"])
    grouped = {
        sid: list(zip(g.offset_min.values, g.code.values))
        for sid, g in ev.groupby("patientunitstayid", sort=False)
    }
    cohort = {}
    for split in ("train", "val", "test"):
        part = splits[splits.split == split]
        cohort[split] = [
            (grouped.get(sid, []), int(y)) for sid, y in zip(part.patientunitstayid, part.mortality)
        ]
    return cohort


class StayDataset(Dataset):
    def __init__(self, items, vocab, max_len):
        self.items = items
        self.vocab = vocab
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, y = self.items[i]
        seq = seq[-self.max_len:]
        ids = [self.vocab.get(c, UNK) for _, c in seq]
        hours = [min(int(t // 60), 23) for t, _ in seq]
        return torch.tensor(ids), torch.tensor(hours), torch.tensor(float(y)), i


def pad_batch(batch):
    ids, hours, ys, idx = zip(*batch)
    L = max(1, max(len(x) for x in ids))
    out_ids = torch.full((len(ids), L), PAD, dtype=torch.long)
    out_hours = torch.zeros((len(ids), L), dtype=torch.long)
    for j, (a, h) in enumerate(zip(ids, hours)):
        out_ids[j, : len(a)] = a
        out_hours[j, : len(h)] = h
    return out_ids, out_hours, torch.stack(ys), torch.tensor(idx)


class CodeTransformer(nn.Module):
    def __init__(self, vocab_size, d_model, n_layers, n_heads, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.hour = nn.Embedding(24, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, 1)

    def forward(self, ids, hours):
        x = self.tok(ids) + self.hour(hours)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)
        pad = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids == PAD], dim=1)
        h = self.encoder(x, src_key_padding_mask=pad)
        return self.out(self.norm(h[:, 0])).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device, n_items):
    model.eval()
    probs, idxs = [], []
    for ids, hours, _, idx in loader:
        logits = model(ids.to(device, non_blocking=True), hours.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logits.float()))
        idxs.append(idx.to(device))
    probs, idxs = torch.cat(probs), torch.cat(idxs)
    world = dist.get_world_size()
    all_p = [torch.empty_like(probs) for _ in range(world)]
    all_i = [torch.empty_like(idxs) for _ in range(world)]
    dist.all_gather(all_p, probs)
    dist.all_gather(all_i, idxs)
    out = torch.zeros(n_items, device=device)
    out[torch.cat(all_i)] = torch.cat(all_p)  # padded duplicates write the same value
    return out.cpu().numpy()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank()
    is_main = rank == 0

    cohort = load_cohort(args.events, args.splits)
    vocab = build_vocab([s for s, _ in cohort["train"]], args.min_count)
    if is_main:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        print(f"vocab {len(vocab)} | train {len(cohort['train'])} val {len(cohort['val'])}", flush=True)

    train_ds = StayDataset(cohort["train"], vocab, args.max_len)
    val_ds = StayDataset(cohort["val"], vocab, args.max_len)
    val_y = np.array([y for _, y in cohort["val"]])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=pad_batch,
                          num_workers=6, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=pad_batch, num_workers=4, pin_memory=True)

    model = CodeTransformer(len(vocab), args.d_model, args.layers, args.heads, args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])

    pos_rate = float(np.mean([y for _, y in cohort["train"]]))
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_rate) / pos_rate, device=device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * max(0.0, 1 - s / total_steps))
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for ids, hours, y, _ in train_dl:
            ids, hours, y = ids.to(device, non_blocking=True), hours.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(ids, hours)
            loss = criterion(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(running)

        p = predict(model, val_dl, device, len(val_ds))
        if is_main:
            auroc = roc_auc_score(val_y, p)
            auprc = average_precision_score(val_y, p)
            print(f"epoch {epoch} loss {(running[0] / running[1]).item():.4f} "
                  f"AUROC {auroc:.4f} AUPRC {auprc:.4f}", flush=True)
            if auroc > best:
                best = auroc
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "auroc": auroc},
                           os.path.join(args.output, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
