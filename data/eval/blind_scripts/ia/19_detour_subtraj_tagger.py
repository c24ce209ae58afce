"""Anomalous sub-trajectory (detour) detection on map-matched taxi routes.

Each route is a sequence of road segments; every segment carries a 0/1 label
saying whether it lies on a detour with respect to the normal routes of the
same source-destination pair (labels from the manual annotation of Chengdu /
Xi'an, RL4OASD protocol). A transformer tags each segment; we report
segment-level ROC-AUC and PR-AUC over the whole test set.

    torchrun --nproc_per_node=4 19_detour_subtraj_tagger.py --city chengdu
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--city", default="chengdu")
    ap.add_argument("--root", default="/data/oasd")
    ap.add_argument("--save", default="ckpt/detour_tagger")
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--pos_weight", type=float, default=4.0)
    return ap.parse_args()


class RouteTags(Dataset):
    def __init__(self, npz_path, max_len):
        z = np.load(npz_path, allow_pickle=True)
        self.routes, self.tags, self.sd = z["routes"], z["tags"], z["sd"]
        self.max_len = max_len

    def __len__(self):
        return len(self.routes)

    def __getitem__(self, i):
        r = np.asarray(self.routes[i][: self.max_len], np.int64) + 1  # 0 = pad
        t = np.asarray(self.tags[i][: self.max_len], np.float32)
        x = np.zeros(self.max_len, np.int64)
        y = np.full(self.max_len, -1.0, np.float32)
        x[: len(r)], y[: len(t)] = r, t
        return torch.from_numpy(x), torch.from_numpy(y), torch.as_tensor(self.sd[i], dtype=torch.long) + 1


class DetourTagger(nn.Module):
    def __init__(self, n_seg, d, layers, max_len):
        super().__init__()
        self.seg = nn.Embedding(n_seg + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.sd_proj = nn.Linear(2 * d, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, 0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.out = nn.Linear(d, 1)

    def forward(self, x, sd):
        T = x.size(1)
        ctx = self.sd_proj(self.seg(sd).flatten(1))
        h = self.seg(x) + self.pos(torch.arange(T, device=x.device)) + ctx[:, None]
        h = self.enc(h, src_key_padding_mask=x.eq(0))
        return self.out(h).squeeze(-1)


@torch.no_grad()
def collect_scores(net, loader, device):
    net.eval()
    scores, labels = [], []
    for x, y, sd in loader:
        x, y, sd = x.to(device), y.to(device), sd.to(device)
        p = torch.sigmoid(net(x, sd))
        m = y >= 0
        scores.append(p[m])
        labels.append(y[m])
    net.train()
    return torch.cat(scores), torch.cat(labels)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    city_dir = os.path.join(args.root, args.city)
    n_seg = int(np.load(os.path.join(city_dir, "num_segments.npy")))
    train_ds = RouteTags(os.path.join(city_dir, "train.npz"), args.max_len)
    test_ds = RouteTags(os.path.join(city_dir, "test.npz"), args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    # every test route is scored exactly once across the ranks
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=256, num_workers=2)

    net = DetourTagger(n_seg, args.d, args.layers, args.max_len).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"{args.city}: segments={n_seg} train routes={len(train_ds)} test routes={len(test_ds)}")

    best_pr = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y, sd in train_dl:
            x, y, sd = x.to(device, non_blocking=True), y.to(device, non_blocking=True), sd.to(device)
            logits = model(x, sd)
            m = y >= 0
            loss = F.binary_cross_entropy_with_logits(logits[m], y[m], pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        scores, labels = collect_scores(net, test_dl, device)
        all_scores = [torch.zeros_like(scores) for _ in range(world)]
        all_labels = [torch.zeros_like(labels) for _ in range(world)]
        dist.all_gather(all_scores, scores)
        dist.all_gather(all_labels, labels)
        if rank == 0:
            s = torch.cat(all_scores).cpu().numpy()
            l = torch.cat(all_labels).cpu().numpy()
            roc, pr = roc_auc_score(l, s), average_precision_score(l, s)
            print(f"epoch {epoch:02d} loss {(run[0] / run[1]).item():.4f} ROC-AUC {roc:.4f} PR-AUC {pr:.4f} "
                  f"segments={len(l)} ({time.time() - t0:.0f}s)", flush=True)
            if pr > best_pr:
                best_pr = pr
                torch.save({"model": net.state_dict(), "epoch": epoch, "pr_auc": pr, "n_seg": n_seg},
                           os.path.join(args.save, f"{args.city}_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
