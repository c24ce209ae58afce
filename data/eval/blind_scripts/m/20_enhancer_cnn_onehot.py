"""
Enhancer activity prediction (STARR-seq, Drosophila S2 cells): 249 bp DNA -> developmental and
housekeeping log2 enrichment (DeepSTARR-like CNN, 2 regression outputs).

Input TSVs from the DeepSTARR release: Sequences_{Train,Val,Test}.fa + Sequences_activity_*.txt

    torchrun --nproc_per_node=4 20_enhancer_cnn_onehot.py --data_dir data/deepstarr
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
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BASES = {"A": 0, "C": 1, "G": 2, "T": 3}


def read_fasta(path):
    seqs, cur = [], []
    with open(path) as f:
        for line in f:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
            else:
                cur.append(line.strip().upper())
    if cur:
        seqs.append("".join(cur))
    return seqs


def load_split(data_dir, split):
    seqs = read_fasta(os.path.join(data_dir, f"Sequences_{split}.fa"))
    act = pd.read_csv(os.path.join(data_dir, f"Sequences_activity_{split}.txt"), sep="\t")
    y = act[["Dev_log2_enrichment", "Hk_log2_enrichment"]].values.astype(np.float32)
    assert len(seqs) == len(y)
    return seqs, y


class STARRDataset(Dataset):
    def __init__(self, seqs, y, device, rc_augment=False):
        self.idx = [np.array([BASES.get(b, 4) for b in s], dtype=np.int64) for s in seqs]
        self.y = torch.from_numpy(y)
        self.device = device
        self.rc_augment = rc_augment
        self.eye = torch.cat([torch.eye(4), torch.full((1, 4), 0.25)]).to(device)  # N -> uniform

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        ids = torch.from_numpy(self.idx[i]).to(self.device)
        x = self.eye[ids].T  # (4, L) one-hot built on the GPU
        if self.rc_augment and torch.rand(1).item() < 0.5:
            x = x.flip(0).flip(1)  # reverse complement for ACGT order
        return x, self.y[i].to(self.device)


class DeepSTARR(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = [(4, 256, 7), (256, 60, 3), (60, 60, 5), (60, 120, 3)]
        layers = []
        for cin, cout, k in cfg:
            layers += [nn.Conv1d(cin, cout, k, padding=k // 2), nn.BatchNorm1d(cout), nn.ReLU(), nn.MaxPool1d(2)]
        self.conv = nn.Sequential(*layers)
        self.fc = nn.Sequential(
            nn.Flatten(),
            nn.Linear(120 * (249 // 16), 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.4),
            nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.4),
            nn.Linear(256, 2),
        )

    def forward(self, x):
        return self.fc(self.conv(x))


@torch.no_grad()
def evaluate(net, loader, world):
    net.eval()
    preds, ys = [], []
    for x, y in loader:
        preds.append(net(x).cpu().numpy())
        ys.append(y.cpu().numpy())
    mine = (np.concatenate(preds), np.concatenate(ys))
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    P = np.concatenate([p[0] for p in parts])
    Y = np.concatenate([p[1] for p in parts])
    out = {}
    for k, name in enumerate(["dev", "hk"]):
        out[f"pcc_{name}"] = pearsonr(P[:, k], Y[:, k])[0]
        out[f"scc_{name}"] = spearmanr(P[:, k], Y[:, k])[0]
        out[f"mse_{name}"] = float(np.mean((P[:, k] - Y[:, k]) ** 2))
    net.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/deepstarr")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="runs/deepstarr_ddp")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tr_seqs, tr_y = load_split(args.data_dir, "Train")
    va_seqs, va_y = load_split(args.data_dir, "Val")
    train_ds = STARRDataset(tr_seqs, tr_y, device, rc_augment=True)
    val_ds = STARRDataset(va_seqs, va_y, device)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024,
                        num_workers=args.workers)

    model = DDP(DeepSTARR().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} val {len(val_ds)} | world {world}", flush=True)

    best, bad_epochs, log = float("inf"), 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        s = torch.zeros(2, device=device)
        for x, y in train_dl:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(s)

        metrics = evaluate(model.module, val_dl, world)
        val_mse = metrics["mse_dev"] + metrics["mse_hk"]
        metrics.update(epoch=epoch, train_mse=(s[0] / s[1]).item(), sec=round(time.time() - t0, 1))
        if val_mse < best:
            best, bad_epochs = val_mse, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        if rank == 0:
            log.append(metrics)
            pd.DataFrame(log).to_csv(os.path.join(args.out, "log.csv"), index=False)
            print(f"ep {epoch:3d} train {metrics['train_mse']:.4f} | PCC dev {metrics['pcc_dev']:.3f} "
                  f"hk {metrics['pcc_hk']:.3f} | {metrics['sec']}s", flush=True)
        if bad_epochs >= args.patience:
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
