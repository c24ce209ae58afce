"""Adaptive GCN on UAV-Human skeletons (COCO-17 layout, 155 actions, cross-subject v1).

Trains with DDP, keeps the best checkpoint, then rank 0 rebuilds the network from
that checkpoint and writes test-set scores (.npy) for the multi-stream ensemble.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

COCO_EDGES = [(15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8),
              (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
V = 17


def coco_graph():
    I = np.eye(V, dtype=np.float32)
    inward = np.zeros((V, V), dtype=np.float32)
    for i, j in COCO_EDGES:
        inward[j, i] = 1
    outward = inward.T.copy()
    for m in (inward, outward):
        s = m.sum(0)
        s[s == 0] = 1
        m /= s
    return np.stack([I, inward, outward])


class UAVFeeder(Dataset):
    def __init__(self, data_path, label_path, window=64, stream="joint", train=False):
        self.data = np.load(data_path, mmap_mode="r")       # N, 3, 305, 17, 2
        self.label = np.load(label_path).astype(np.int64)
        self.window, self.stream, self.train = window, stream, train

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        x = np.array(self.data[i], dtype=np.float32)
        t = max(int((np.abs(x).sum(axis=(0, 2, 3)) > 0).sum()), 1)
        if self.train:
            span = max(int(t * np.random.uniform(0.75, 1.0)), 1)
            s = np.random.randint(0, t - span + 1)
            idx = np.linspace(s, s + span - 1, self.window).round().astype(np.int64)
        else:
            idx = np.linspace(0, t - 1, self.window).round().astype(np.int64)
        x = x[:, idx]
        if self.stream == "bone":
            b = np.zeros_like(x)
            for a, c in COCO_EDGES:
                b[:, :, a] = x[:, :, a] - x[:, :, c]
            x = b
        return torch.from_numpy(x), int(self.label[i])


class AdaptiveGC(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.PA = nn.Parameter(torch.from_numpy(A).clone())
        inter = cout // 4
        self.q = nn.ModuleList([nn.Conv2d(cin, inter, 1) for _ in range(3)])
        self.k = nn.ModuleList([nn.Conv2d(cin, inter, 1) for _ in range(3)])
        self.v = nn.ModuleList([nn.Conv2d(cin, cout, 1) for _ in range(3)])
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        n, c, t, v = x.shape
        y = 0
        for k in range(3):
            q = self.q[k](x).mean(2)                        # n, inter, v
            kk = self.k[k](x).mean(2)
            att = torch.softmax(torch.einsum("ncu,ncv->nuv", q, kk) / q.shape[1] ** 0.5, -1)
            y = y + torch.einsum("nctu,nuv->nctv", self.v[k](x), self.PA[k] + att)
        y = F.relu(self.bn(y) + self.down(x))
        return F.relu(self.tcn(y) + self.res(x))


class AGCN(nn.Module):
    def __init__(self, num_class=155, in_channels=3, num_person=2):
        super().__init__()
        A = coco_graph()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * V)
        plan = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1),
                (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.layers = nn.Sequential(*[AdaptiveGC(a, b, A, s) for a, b, s in plan])
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        x = self.layers(x)
        return self.fc(x.view(n, m, x.shape[1], -1).mean(-1).mean(1))


@torch.no_grad()
def scores_of(net, loader, device):
    net.eval()
    out = []
    for x, _ in loader:
        out.append(net(x.to(device, non_blocking=True)).float().cpu())
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="config/uav/csv1_joint.yaml")
    ap.add_argument("--work-dir", default=None)
    cli = ap.parse_args()
    cfg = yaml.safe_load(open(cli.config))
    work_dir = cli.work_dir or cfg["work_dir"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 1))

    stream = cfg.get("stream", "joint")
    tr = UAVFeeder(cfg["train_data"], cfg["train_label"], cfg.get("window", 64), stream, train=True)
    te = UAVFeeder(cfg["test_data"], cfg["test_label"], cfg.get("window", 64), stream)
    tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_loader = DataLoader(tr, batch_size=cfg["batch_size"] // world, sampler=tr_sampler,
                           num_workers=cfg.get("num_worker", 8), pin_memory=True, drop_last=True)
    te_loader = DataLoader(te, batch_size=cfg.get("test_batch_size", 128), shuffle=False,
                           num_workers=cfg.get("num_worker", 8), pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AGCN(cfg["num_class"])).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["base_lr"], momentum=0.9, nesterov=True,
                                weight_decay=cfg.get("weight_decay", 5e-4))
    milestones = cfg.get("step", [35, 55])
    warm = cfg.get("warm_up_epoch", 5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: (e + 1) / warm if e < warm else 0.1 ** sum(e >= s for s in milestones))

    best_path = os.path.join(work_dir, "best.pt")
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
    best, labels = 0.0, torch.as_tensor(te.label)
    for epoch in range(cfg["num_epoch"]):
        tr_sampler.set_epoch(epoch)
        model.train()
        tic, loss_sum = time.time(), torch.zeros(2, device=device)
        for x, y in tr_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        if rank == 0 and ((epoch + 1) % cfg.get("eval_interval", 5) == 0 or epoch + 1 == cfg["num_epoch"]):
            s = scores_of(model.module, te_loader, device)
            p5 = s.topk(5, 1).indices
            top1 = (p5[:, 0] == labels).float().mean().item()
            top5 = (p5 == labels[:, None]).any(1).float().mean().item()
            print(f"[{stream}] epoch {epoch + 1} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"top1 {top1:.4f} top5 {top5:.4f} ({time.time() - tic:.0f}s)", flush=True)
            if top1 > best:
                best = top1
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        net = AGCN(cfg["num_class"]).to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        s = scores_of(net, te_loader, device)
        np.save(os.path.join(work_dir, f"test_scores_{stream}.npy"), s.numpy())
        top1 = (s.argmax(1) == labels).float().mean().item()
        print(f"[{stream}] best checkpoint re-evaluated: top1 {top1:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
