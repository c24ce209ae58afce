"""ASL Citizen (2,731 signs, crowdsourced, signer-disjoint splits): pose GCN baseline.

Trains on MediaPipe pose+hand landmarks, keeps the best validation checkpoint, then scores the
test split (top-1 / top-5 / MRR) and exports TorchScript for the dictionary-lookup demo.

    torchrun --nproc_per_node=4 13_asl_citizen_pose_gcn_export.py --data /data/ASL_Citizen
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

POSE = [0, 11, 12, 13, 14, 15, 16]  # nose, shoulders, elbows, wrists
NUM_NODES = len(POSE) + 42
T_FIXED = 64


def graph():
    e = [(0, 1), (0, 2), (1, 2), (1, 3), (3, 5), (2, 4), (4, 6)]
    for root, wrist in ((7, 5), (28, 6)):
        e.append((wrist, root))
        for f in range(5):
            e.append((root, root + 1 + 4 * f))
            e += [(root + 1 + 4 * f + k, root + 2 + 4 * f + k) for k in range(3)]
    A = np.eye(NUM_NODES, dtype=np.float32)
    for i, j in e:
        A[i, j] = A[j, i] = 1
    D = np.diag(A.sum(1) ** -0.5)
    return torch.from_numpy(D @ A @ D)


class CitizenPoses(Dataset):
    def __init__(self, root, split, gloss2id, train):
        df = pd.read_csv(os.path.join(root, "splits", f"{split}.csv"))
        self.items = [(os.path.splitext(v)[0], gloss2id[g]) for v, g in zip(df["Video file"], df["Gloss"])]
        self.pose_dir = os.path.join(root, "pose")
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, label = self.items[i]
        d = np.load(os.path.join(self.pose_dir, name + ".npz"))
        kp = np.concatenate([d["pose"][:, POSE, :2], d["left_hand"][..., :2], d["right_hand"][..., :2]], 1)
        kp = np.nan_to_num(kp.astype(np.float32))
        t = len(kp)
        if self.train:
            s = np.random.uniform(0.0, 0.15) * t
            e = t - np.random.uniform(0.0, 0.15) * t
            idx = np.linspace(s, e - 1, T_FIXED)
            kp = kp @ np.array([[1, np.random.uniform(-0.1, 0.1)], [np.random.uniform(-0.1, 0.1), 1]], np.float32)
        else:
            idx = np.linspace(0, t - 1, T_FIXED)
        kp = kp[np.clip(idx.round().astype(int), 0, t - 1)]
        kp = kp - kp[:, :1]
        return torch.from_numpy(kp).permute(2, 0, 1), label  # C T V


class GCNUnit(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.register_buffer("A", A)
        self.PA = nn.Parameter(torch.zeros_like(A))  # learned residual adjacency
        self.gc = nn.Conv2d(cin, cout, 1)
        self.tc = nn.Sequential(nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                                nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1 else
                    nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = torch.einsum("nctv,vw->nctw", self.gc(x), self.A + self.PA)
        return F.relu(self.tc(y) + self.res(x))


class PoseGCN(nn.Module):
    def __init__(self, num_classes, A):
        super().__init__()
        self.bn_in = nn.BatchNorm1d(2 * NUM_NODES)
        cfg = [(2, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.layers = nn.Sequential(*[GCNUnit(a, b, A, s) for a, b, s in cfg])
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x):
        n, c, t, v = x.shape
        x = self.bn_in(x.permute(0, 1, 3, 2).reshape(n, c * v, t)).view(n, c, v, t).permute(0, 1, 3, 2)
        return self.fc(self.drop(self.layers(x).mean((2, 3))))


def retrieval_metrics(logits, y):
    rank_of_true = (logits > logits.gather(1, y[:, None])).sum(1)  # 0-based
    return {"top1": (rank_of_true < 1).float().mean().item(), "top5": (rank_of_true < 5).float().mean().item(),
            "mrr": (1.0 / (rank_of_true + 1).float()).mean().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/ASL_Citizen")
    ap.add_argument("--epochs", type=int, default=75)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/citizen_gcn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    glosses = sorted(pd.read_csv(os.path.join(args.data, "splits", "train.csv"))["Gloss"].unique())
    gloss2id = {g: i for i, g in enumerate(glosses)}
    train_ds = CitizenPoses(args.data, "train", gloss2id, True)
    val_ds = CitizenPoses(args.data, "val", gloss2id, False)
    test_ds = CitizenPoses(args.data, "test", gloss2id, False)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 256, num_workers=4)

    A = graph()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseGCN(len(glosses), A)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, total_steps=args.epochs * len(train_dl))

    best_path = os.path.join(args.out, "best.pt")
    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "glosses.json"), "w") as f:
            json.dump(glosses, f)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                y = y.to(device)
                hits[0] += (model(x.to(device)).argmax(1) == y).sum()
                hits[1] += len(y)
        dist.all_reduce(hits)
        val_acc = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.3f} val top-1 {val_acc * 100:.2f}", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_acc": val_acc}, best_path)
        dist.barrier()

    if rank == 0:
        # final test + export with a plain (unwrapped) copy of the network
        net = PoseGCN(len(glosses), A)
        net.load_state_dict(torch.load(best_path, map_location="cpu")["model"])
        net = net.to(device).eval()
        test_dl = DataLoader(test_ds, 256, num_workers=8)
        all_logits, all_y = [], []
        with torch.no_grad():
            for x, y in test_dl:
                all_logits.append(net(x.to(device)).float().cpu())
                all_y.append(y)
        m = retrieval_metrics(torch.cat(all_logits), torch.cat(all_y))
        print(f"TEST top-1 {m['top1'] * 100:.2f} top-5 {m['top5'] * 100:.2f} MRR {m['mrr']:.4f}")
        scripted = torch.jit.trace(net.cpu(), torch.zeros(1, 2, T_FIXED, NUM_NODES))
        scripted.save(os.path.join(args.out, "pose_gcn_traced.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
