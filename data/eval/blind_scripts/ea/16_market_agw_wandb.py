"""
AGW baseline (non-local blocks, GeM pooling, weighted regularized triplet, BNNeck)
on Market-1501, tracked in Weights & Biases.

    torchrun --nproc_per_node=4 16_market_agw_wandb.py --root /data/Market-1501-v15.09.15 --run-name agw_r50_4gpu
"""
import argparse
import os
import os.path as osp
import random
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50, ResNet50_Weights


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run-name", default="agw_r50")
    p.add_argument("--project", default="reid-surveillance")
    p.add_argument("--ims-per-batch", type=int, default=64)
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--save-dir", default="checkpoints/agw")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def parse_market(d, relabel):
    pat = re.compile(r"([-\d]+)_c(\d)")
    rows = []
    for f in sorted(glob(osp.join(d, "*.jpg"))):
        pid, cam = map(int, pat.search(osp.basename(f)).groups())
        if pid >= 0:
            rows.append((f, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({r[1] for r in rows}))}
        rows = [(f, lut[pid], c) for f, pid, c in rows]
    return rows


class Rows(Dataset):
    def __init__(self, rows, tf):
        self.rows, self.tf = rows, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        f, pid, cam = self.rows[i]
        return self.tf(Image.open(f).convert("RGB")), pid, cam


class DistIdentitySampler(Sampler):
    def __init__(self, rows, batch, k, rank, world, seed=0):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.local = batch // world
        self.epoch = 0
        self.pool = defaultdict(list)
        for i, r in enumerate(rows):
            self.pool[r[1]].append(i)
        self.ids = sorted(self.pool)
        self.n = sum(max(len(v), k) // k for v in self.pool.values()) * k // batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n * self.local

    def __iter__(self):
        rng = random.Random(1000 * self.seed + self.epoch)
        bags = {}
        for i in self.ids:
            v = list(self.pool[i])
            if len(v) < self.k:
                v += [rng.choice(v) for _ in range(self.k - len(v))]
            rng.shuffle(v)
            bags[i] = [v[j:j + self.k] for j in range(0, len(v) - self.k + 1, self.k)]
        live, order = list(self.ids), []
        while len(live) >= self.batch // self.k and len(order) < self.n * self.batch:
            for i in rng.sample(live, self.batch // self.k):
                order += bags[i].pop()
                if not bags[i]:
                    live.remove(i)
        for b in range(len(order) // self.batch):
            yield from order[b * self.batch + self.rank * self.local:][:self.local]


class NonLocal(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.inter = c // 2
        self.g = nn.Conv2d(c, self.inter, 1)
        self.theta = nn.Conv2d(c, self.inter, 1)
        self.phi = nn.Conv2d(c, self.inter, 1)
        self.W = nn.Sequential(nn.Conv2d(self.inter, c, 1), nn.BatchNorm2d(c))
        nn.init.zeros_(self.W[1].weight)
        nn.init.zeros_(self.W[1].bias)

    def forward(self, x):
        b, c, h, w = x.shape
        g = self.g(x).flatten(2).transpose(1, 2)
        t = self.theta(x).flatten(2).transpose(1, 2)
        p = self.phi(x).flatten(2)
        attn = (t @ p) / (h * w)
        y = (attn @ g).transpose(1, 2).reshape(b, self.inter, h, w)
        return x + self.W(y)


class AGW(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.layer2 = nn.Sequential(*r.layer2[:-1], NonLocal(512), r.layer2[-1])
        self.layer3 = nn.Sequential(*r.layer3[:-1], NonLocal(1024), r.layer3[-1])
        self.layer4 = r.layer4
        self.p = nn.Parameter(torch.tensor(3.0))
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.cls = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.cls.weight, std=0.001)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.stem(x))))
        f = F.adaptive_avg_pool2d(x.clamp(min=1e-6).pow(self.p), 1).pow(1.0 / self.p).flatten(1)
        b = self.neck(f)
        return (self.cls(b), f) if self.training else b


def weighted_regularized_triplet(f, y):
    d = torch.cdist(f, f)
    pos = (y[:, None] == y[None]).float()
    neg = 1.0 - pos
    d_ap, d_an = d * pos, d * neg
    w_ap = torch.softmax(d_ap - (1 - pos) * 1e4, dim=1)
    w_an = torch.softmax(-d_an - (1 - neg) * 1e4, dim=1)
    fp = (d_ap * w_ap).sum(1)
    fn = (d_an * w_an).sum(1)
    return F.softplus(fp - fn).mean()


@torch.no_grad()
def evaluate(net, query, gallery, tf, device):
    net.eval()
    dl = DataLoader(Rows(query + gallery, tf), batch_size=256, num_workers=8, pin_memory=True)
    f = F.normalize(torch.cat([net(x.to(device)) for x, _, _ in dl]), dim=1)
    dm = torch.cdist(f[:len(query)], f[len(query):]).cpu().numpy()
    qp, qc = np.array([r[1] for r in query]), np.array([r[2] for r in query])
    gp, gc = np.array([r[1] for r in gallery]), np.array([r[2] for r in gallery])
    aps, cmc, inp = [], np.zeros(10), []
    nv = 0
    for i in range(len(query)):
        o = np.argsort(dm[i])
        keep = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        m = gp[o][keep] == qp[i]
        if not m.any():
            continue
        nv += 1
        h = np.flatnonzero(m)
        aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
        inp.append(len(h) / (h[-1] + 1))
        if h[0] < 10:
            cmc[h[0]:] += 1
    return {"mAP": float(np.mean(aps)), "mINP": float(np.mean(inp)), "R1": cmc[0] / nv, "R5": cmc[4] / nv}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    train = parse_market(osp.join(args.root, "bounding_box_train"), True)
    query = parse_market(osp.join(args.root, "query"), False)
    gallery = parse_market(osp.join(args.root, "bounding_box_test"), False)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = DistIdentitySampler(train, args.ims_per_batch, args.num_instances, rank, world)
    loader = DataLoader(Rows(train, tf), batch_size=args.ims_per_batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(AGW(len({r[1] for r in train}))).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: (e + 1) / 10 if e < 10 else 0.1 ** sum(e >= m for m in (40, 70)))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x)
            l_id = ce(logits, y)
            l_wrt = weighted_regularized_triplet(feat, y)
            opt.zero_grad(set_to_none=True)
            (l_id + l_wrt).backward()
            opt.step()
            step += 1
            if step % 20 == 0:
                vals = torch.stack([l_id.detach(), l_wrt.detach()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                wandb.log({"train/id_loss": vals[0].item(), "train/wrt_loss": vals[1].item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)
        sched.step()

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                res = evaluate(net, query, gallery, test_tf, device)
                print(f"epoch {epoch + 1} ({time.time() - t0:.0f}s): " +
                      " ".join(f"{k} {100 * v:.1f}" for k, v in res.items()), flush=True)
                wandb.log({f"val/{k}": v for k, v in res.items()}, step=step)
                torch.save(net.state_dict(), osp.join(args.save_dir, f"agw_ep{epoch + 1}.pth"))
            dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
