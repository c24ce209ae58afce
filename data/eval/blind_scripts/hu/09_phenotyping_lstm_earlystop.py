"""Acute care phenotyping (25 labels, MIMIC-III benchmark) with a channel-wise LSTM.

Inputs are the benchmark's discretized episodes (1h bins, 17 clinical variables,
imputed + mask channels). Macro AUROC on the validation set drives early stopping.

  torchrun --nnodes=1 --nproc_per_node=4 09_phenotyping_lstm_earlystop.py \
      --data /data/mimic3-benchmarks/phenotyping_npz --out runs/pheno_lstm
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PHENOTYPES = [
    "Acute and unspecified renal failure", "Acute cerebrovascular disease", "Acute myocardial infarction",
    "Cardiac dysrhythmias", "Chronic kidney disease", "Chronic obstructive pulmonary disease",
    "Complications of surgical procedures or medical care", "Conduction disorders",
    "Congestive heart failure; nonhypertensive", "Coronary atherosclerosis and other heart disease",
    "Diabetes mellitus with complications", "Diabetes mellitus without complication",
    "Disorders of lipid metabolism", "Essential hypertension", "Fluid and electrolyte disorders",
    "Gastrointestinal hemorrhage", "Hypertension with complications and secondary hypertension",
    "Other liver diseases", "Other lower respiratory disease", "Other upper respiratory disease",
    "Pleurisy; pneumothorax; pulmonary collapse", "Pneumonia", "Respiratory failure; insufficiency; arrest",
    "Septicemia (except in labor)", "Shock",
]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max_epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--max_hours", type=int, default=400)
    return ap.parse_args()


class Episodes(Dataset):
    def __init__(self, path, max_hours):
        d = np.load(path, allow_pickle=True)
        self.X = d["X"]  # object array of [T_i, 76]
        self.y = d["y"].astype(np.float32)  # [N, 25]
        self.max_hours = max_hours

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = self.X[i][-self.max_hours:].astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(self.y[i]), i


def collate(batch):
    xs, ys, idx = zip(*batch)
    lens = torch.tensor([len(x) for x in xs])
    X = nn.utils.rnn.pad_sequence(xs, batch_first=True)
    return X, lens, torch.stack(ys), torch.tensor(idx)


class ChannelWiseLSTM(nn.Module):
    """One small bidirectional LSTM per variable group, then a shared LSTM."""

    def __init__(self, d_in, hidden, n_out, dropout, n_groups=17):
        super().__init__()
        self.group_size = d_in // n_groups
        self.channels = nn.ModuleList(
            nn.LSTM(self.group_size, hidden // 4, batch_first=True, bidirectional=True)
            for _ in range(n_groups)
        )
        self.rest = d_in - n_groups * self.group_size
        self.top = nn.LSTM(n_groups * (hidden // 2) + self.rest, hidden, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x, lens):
        outs = []
        for g, lstm in enumerate(self.channels):
            xg = x[:, :, g * self.group_size:(g + 1) * self.group_size]
            packed = nn.utils.rnn.pack_padded_sequence(xg, lens.cpu(), batch_first=True, enforce_sorted=False)
            o, _ = lstm(packed)
            o, _ = nn.utils.rnn.pad_packed_sequence(o, batch_first=True, total_length=x.size(1))
            outs.append(o)
        if self.rest:
            outs.append(x[:, :, -self.rest:])
        h = self.drop(torch.cat(outs, dim=-1))
        packed = nn.utils.rnn.pack_padded_sequence(h, lens.cpu(), batch_first=True, enforce_sorted=False)
        _, (hn, _) = self.top(packed)
        return self.out(self.drop(hn[-1]))


@torch.no_grad()
def predict_all(model, ds, device, rank, world):
    # strided, unpadded shards; results are scattered back by index
    shard = torch.utils.data.Subset(ds, list(range(rank, len(ds), world)))
    loader = DataLoader(shard, batch_size=64, collate_fn=collate, num_workers=2)
    model.eval()
    probs = torch.zeros(len(ds), len(PHENOTYPES), device=device)
    for X, lens, _, idx in loader:
        probs[idx.to(device)] = torch.sigmoid(model(X.to(device), lens))
    dist.all_reduce(probs)  # disjoint shards, so the sum is the full matrix
    return probs.cpu().numpy()


def macro_auroc(y, p):
    per = [roc_auc_score(y[:, k], p[:, k]) for k in range(y.shape[1])]
    return float(np.mean(per)), per


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = Episodes(os.path.join(args.data, "train.npz"), args.max_hours)
    val_ds = Episodes(os.path.join(args.data, "val.npz"), args.max_hours)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True)

    model = ChannelWiseLSTM(train_ds.X[0].shape[1], args.hidden, len(PHENOTYPES), args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, bad_epochs = -1.0, 0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for X, lens, y, _ in loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(X, lens), y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        probs = predict_all(model.module, val_ds, device, rank, world)
        should_stop = False
        if rank == 0:
            auc, per = macro_auroc(val_ds.y, probs)
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} macro-AUROC {auc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best, bad_epochs = auc, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                with open(os.path.join(args.out, "val_per_label.json"), "w") as f:
                    json.dump(dict(zip(PHENOTYPES, per)), f, indent=1)
            else:
                bad_epochs += 1
            should_stop = bad_epochs >= args.patience

        flag = torch.tensor([int(should_stop)])
        dist.broadcast(flag, src=0)
        if flag.item():
            if rank == 0:
                print(f"early stop at epoch {epoch}, best macro-AUROC {best:.4f}", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
