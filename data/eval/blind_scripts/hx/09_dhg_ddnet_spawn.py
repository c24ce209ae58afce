"""DD-Net style skeleton gesture recognition on DHG-14/28, leave-one-subject-out.

Joint-collection distances + two-scale global motion, 1D CNN. One process per GPU, spawned here:

    python 09_dhg_ddnet_spawn.py --config configs/dhg14.yaml --test-subject 3 --gpus 2
"""
import argparse
import os
import pickle
import time

import numpy as np
import scipy.ndimage
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from scipy.spatial.distance import cdist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NUM_JOINTS = 22
FRAMES = 32


def zoom(seq, target=FRAMES):
    t = seq.shape[0]
    out = np.empty((target,) + seq.shape[1:], np.float32)
    for j in range(seq.shape[1]):
        for c in range(seq.shape[2]):
            out[:, j, c] = scipy.ndimage.zoom(seq[:, j, c], target / t, order=1)[:target]
    return out


def jcd(seq):
    iu = np.triu_indices(NUM_JOINTS, 1)
    feats = np.stack([cdist(f, f, "euclidean")[iu] for f in seq])
    return (feats - feats.mean(0)) / (feats.std(0) + 1e-6)


class DHGSequences(Dataset):
    def __init__(self, samples, train):
        self.samples = samples
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        seq, label = self.samples[i]["skeleton"], self.samples[i]["label"]
        if self.train:
            t = len(seq)
            cut = np.random.randint(0, max(1, t // 10))
            seq = seq[cut:t - np.random.randint(0, max(1, t // 10))]
            seq = seq * np.random.uniform(0.9, 1.1)
        seq = zoom(seq.astype(np.float32))
        seq = seq - seq.mean(axis=(0, 1), keepdims=True)
        return torch.from_numpy(jcd(seq)).float(), torch.from_numpy(seq.reshape(FRAMES, -1)).float(), label


def c1d(cin, cout, k):
    return nn.Sequential(nn.Conv1d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm1d(cout), nn.LeakyReLU(0.2))


class DDNet(nn.Module):
    def __init__(self, num_classes, filters=64, drop=0.1):
        super().__init__()
        jcd_dim = NUM_JOINTS * (NUM_JOINTS - 1) // 2
        pose_dim = NUM_JOINTS * 3

        def branch(d):
            return nn.Sequential(c1d(d, 2 * filters, 1), nn.Dropout(drop), c1d(2 * filters, filters, 3),
                                 nn.Dropout(drop), c1d(filters, filters, 1))

        self.jcd = branch(jcd_dim)
        self.slow = branch(pose_dim)
        self.fast = branch(pose_dim)
        self.trunk = nn.Sequential(
            c1d(3 * filters, 2 * filters, 3), c1d(2 * filters, 2 * filters, 3), nn.MaxPool1d(2), nn.Dropout(drop),
            c1d(2 * filters, 4 * filters, 3), c1d(4 * filters, 4 * filters, 3), nn.MaxPool1d(2), nn.Dropout(drop),
            c1d(4 * filters, 8 * filters, 3), c1d(8 * filters, 8 * filters, 3))
        self.head = nn.Sequential(nn.Linear(8 * filters, 128), nn.BatchNorm1d(128), nn.LeakyReLU(0.2),
                                  nn.Dropout(0.5), nn.Linear(128, num_classes))

    def forward(self, jcd_feat, pose):
        slow = F.pad(pose[:, 1:] - pose[:, :-1], (0, 0, 0, 1))
        fast = pose[:, 2::2] - pose[:, :-2:2]
        a = self.jcd(jcd_feat.transpose(1, 2))
        b = self.slow(slow.transpose(1, 2))
        c = F.interpolate(self.fast(fast.transpose(1, 2)), size=a.shape[-1])
        x = self.trunk(torch.cat([a, b, c], 1))
        return self.head(x.amax(-1))


def run(rank, world_size, cfg):
    os.environ["MASTER_ADDR"] = cfg.get("master_addr", "localhost")
    os.environ["MASTER_PORT"] = str(cfg.get("master_port", 12355))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    with open(cfg["data_pkl"], "rb") as f:
        data = pickle.load(f)  # list of {"skeleton": (T,22,3), "label_14", "label_28", "subject"}
    key = f"label_{cfg['num_classes']}"
    samples = [{"skeleton": d["skeleton"], "label": d[key] - 1, "subject": d["subject"]} for d in data]
    train = [s for s in samples if s["subject"] != cfg["test_subject"]]
    test = [s for s in samples if s["subject"] == cfg["test_subject"]]
    train_set, test_set = DHGSequences(train, True), DHGSequences(test, False)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_set, cfg["batch_size"], sampler=sampler, num_workers=4, drop_last=True,
                              pin_memory=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), 128, num_workers=2)

    model = DDNet(cfg["num_classes"], cfg.get("filters", 64))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, "min", factor=0.5, patience=5, min_lr=5e-6)

    best = 0.0
    os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tot = torch.zeros(2, device=device)
        for jc, pose, y in train_loader:
            jc, pose, y = jc.to(device), pose.to(device), y.to(device)
            loss = F.cross_entropy(model(jc, pose), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(tot)
        train_loss = (tot[0] / tot[1]).item()
        sched.step(train_loss)

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for jc, pose, y in test_loader:
                pred = model(jc.to(device), pose.to(device)).argmax(1)
                hits += torch.stack([(pred == y.to(device)).sum().float(), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"[subject {cfg['test_subject']}] epoch {epoch} loss {train_loss:.4f} acc {acc * 100:.2f} "
                  f"({time.time() - tic:.1f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(),
                           os.path.join(cfg["out_dir"], f"ddnet_dhg{cfg['num_classes']}_s{cfg['test_subject']}.pt"))
    if rank == 0:
        print(f"best acc for subject {cfg['test_subject']}: {best * 100:.2f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--test-subject", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["test_subject"] = args.test_subject
    world_size = args.gpus
    mp.spawn(run, args=(cfg, world_size), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
