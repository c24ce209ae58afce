"""CTR-GCN on Northwestern-UCLA (views 1+2 train, view 3 test), joint or bone input.

Samples are the usual per-clip json files: {"skeletons": [[[x, y, z] * 20] * T], "label": 1..10}
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

UCLA_PAIRS = [(1, 2), (2, 3), (4, 3), (5, 3), (6, 5), (7, 6), (8, 7), (9, 3), (10, 9), (11, 10),
              (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19)]
NJ = 20


class UCLAFeeder(Dataset):
    def __init__(self, root, split_file, window=52, bone=False, train=True):
        with open(split_file) as f:
            self.files = [line.strip() for line in f if line.strip()]
        self.root, self.window, self.bone, self.train = root, window, bone, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(os.path.join(self.root, self.files[i] + ".json")) as f:
            info = json.load(f)
        sk = np.asarray(info["skeletons"], dtype=np.float32)            # T, 20, 3
        label = int(info["label"]) - 1
        sk = sk - sk[0:1, 1:2]                                          # centre on first-frame hip
        t = len(sk)
        if self.train:
            s = random.randint(0, max(t // 8, 0))
            e = t - random.randint(0, max(t // 8, 0))
            sk = sk[s:max(e, s + 1)]
            ang = np.random.uniform(-0.3, 0.3)
            r = np.array([[np.cos(ang), 0, np.sin(ang)], [0, 1, 0], [-np.sin(ang), 0, np.cos(ang)]], np.float32)
            sk = sk @ r.T
        idx = np.linspace(0, len(sk) - 1, self.window).round().astype(np.int64)
        sk = sk[idx]
        if self.bone:
            b = np.zeros_like(sk)
            for v1, v2 in UCLA_PAIRS:
                b[:, v1 - 1] = sk[:, v1 - 1] - sk[:, v2 - 1]
            sk = b
        return torch.from_numpy(sk.transpose(2, 0, 1)[..., None].copy()), label, i   # C, T, V, M=1


def ucla_graph():
    I = np.eye(NJ, dtype=np.float32)
    fwd = np.zeros((NJ, NJ), dtype=np.float32)
    for a, b in UCLA_PAIRS:
        fwd[b - 1, a - 1] = 1

    def n(m):
        d = m.sum(0)
        d[d == 0] = 1
        return m / d

    return np.stack([I, n(fwd), n(fwd.T)])


class CTRGC(nn.Module):
    def __init__(self, cin, cout, r=8):
        super().__init__()
        rel = 8 if cin <= 16 else cin // r
        self.c1, self.c2 = nn.Conv2d(cin, rel, 1), nn.Conv2d(cin, rel, 1)
        self.c3, self.c4 = nn.Conv2d(cin, cout, 1), nn.Conv2d(rel, cout, 1)

    def forward(self, x, A, alpha):
        a, b = self.c1(x).mean(-2), self.c2(x).mean(-2)
        rel = self.c4(torch.tanh(a.unsqueeze(-1) - b.unsqueeze(-2))) * alpha + A
        return torch.einsum("ncuv,nctv->nctu", rel, self.c3(x))


class TCNGCN(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.PA = nn.Parameter(torch.from_numpy(A).clone())
        self.alpha = nn.Parameter(torch.zeros(1))
        self.gcs = nn.ModuleList([CTRGC(cin, cout) for _ in range(A.shape[0])])
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (5, 1), (stride, 1), (2, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = sum(g(x, self.PA[k], self.alpha) for k, g in enumerate(self.gcs))
        y = F.relu(self.bn(y) + self.down(x))
        return F.relu(self.tcn(y) + self.res(x))


class Model(nn.Module):
    def __init__(self, num_class=10, in_channels=3):
        super().__init__()
        A = ucla_graph()
        self.data_bn = nn.BatchNorm1d(in_channels * NJ)
        spec = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1),
                (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.l = nn.Sequential(*[TCNGCN(a, b, A, s) for a, b, s in spec])
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n * m, v * c, t))
        x = x.view(n * m, v, c, t).permute(0, 2, 3, 1)
        x = self.l(x)
        return self.fc(x.view(n, m, 256, -1).mean(-1).mean(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/NW-UCLA/all_sqe")
    ap.add_argument("--train-list", default="data/NW-UCLA/train_v12.txt")
    ap.add_argument("--val-list", default="data/NW-UCLA/val_v3.txt")
    ap.add_argument("--bone", action="store_true")
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=65)
    ap.add_argument("--out", default="work_dir/ucla")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    stream = "bone" if args.bone else "joint"
    run = wandb.init(project="nwucla-ctrgcn", name=f"{stream}-{world}gpu", config=vars(args))

    train_set = UCLAFeeder(args.root, args.train_list, bone=args.bone, train=True)
    val_set = UCLAFeeder(args.root, args.val_list, bone=args.bone, train=False)
    tr_sampler = DistributedSampler(train_set, shuffle=True)
    va_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=tr_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=va_sampler, num_workers=4, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 16 / 4
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=4e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [50], 0.1)
    out_dir = os.path.join(args.out, stream)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_m = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_m += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_m)

        model.eval()
        s_list, i_list = [], []
        with torch.no_grad():
            for x, _, idx in val_loader:
                s_list.append(model(x.to(device, non_blocking=True)).float())
                i_list.append(idx.to(device))
        scores, ids = torch.cat(s_list), torch.cat(i_list)
        all_scores = torch.empty(world * scores.shape[0], scores.shape[1], device=device)
        all_ids = torch.empty(world * ids.shape[0], dtype=ids.dtype, device=device)
        dist.all_gather_into_tensor(all_scores, scores)
        dist.all_gather_into_tensor(all_ids, ids)

        if rank == 0:
            uniq = {}
            for k, s in zip(all_ids.tolist(), all_scores):
                uniq[k] = s
            keys = sorted(uniq)
            S = torch.stack([uniq[k] for k in keys])
            Y = torch.tensor([val_set[k][1] for k in keys], device=device)
            top1 = (S.argmax(1) == Y).float().mean().item()
            top5 = (S.topk(5, 1).indices == Y[:, None]).any(1).float().mean().item()
            mean_loss = (loss_m[0] / loss_m[1]).item()
            print(f"[{stream}] ep {epoch + 1} loss {mean_loss:.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            run.log({"train/loss": mean_loss, "val/top1": top1, "val/top5": top5,
                     "lr": sched.get_last_lr()[0]}, step=epoch + 1)
            torch.save(model.module.state_dict(), os.path.join(out_dir, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
                np.save(os.path.join(out_dir, "best_scores.npy"), S.cpu().numpy())
        dist.barrier()

    if rank == 0:
        run.summary["best_top1"] = best
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
