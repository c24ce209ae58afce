"""
ResNeXt50 BNNeck re-ID on MSMT17_V1. The 93k-image test set is embedded on all
GPUs and gathered for ranking.

    torchrun --nproc_per_node=8 19_msmt_resnext_gather.py --root /data/MSMT17_V1
"""
import argparse
import os
import os.path as osp
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision.models import resnext50_32x4d, ResNeXt50_32X4D_Weights


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--batch", type=int, default=128, help="global batch (P x K)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--work-dir", default="work_dirs/msmt_rx50")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read_msmt(root, list_file, sub):
    recs = []
    with open(osp.join(root, list_file)) as f:
        for line in f:
            rel, pid = line.split()
            cam = int(osp.basename(rel).split("_")[2]) - 1
            recs.append((osp.join(root, sub, rel), int(pid), cam))
    return recs


class Recs(Dataset):
    def __init__(self, recs, tf):
        self.recs, self.tf = recs, tf

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        p, pid, cam = self.recs[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedPKSampler(Sampler):
    def __init__(self, recs, batch, k, rank, world, seed=5):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.local = batch // world
        self.epoch = 0
        self.index = defaultdict(list)
        for i, (_, pid, _) in enumerate(recs):
            self.index[pid].append(i)
        self.pids = sorted(self.index)
        self.n = sum(max(len(v), k) // k for v in self.index.values()) * k // batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n * self.local

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            v = torch.tensor(self.index[pid])
            if len(v) < self.k:
                v = v[torch.randint(len(v), (self.k,), generator=g)]
            v = v[torch.randperm(len(v), generator=g)]
            chunks[pid] = list(v[: len(v) // self.k * self.k].view(-1, self.k).tolist())
        live, seq = list(self.pids), []
        while len(live) >= self.batch // self.k and len(seq) < self.n * self.batch:
            sel = torch.randperm(len(live), generator=g)[: self.batch // self.k].tolist()
            for pid in [live[s] for s in sel]:
                seq += chunks[pid].pop()
            live = [pid for pid in live if chunks[pid]]
        for b in range(len(seq) // self.batch):
            off = b * self.batch + self.rank * self.local
            yield from seq[off:off + self.local]


class Model(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnext50_32x4d(weights=ResNeXt50_32X4D_Weights.IMAGENET1K_V2)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.fc = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.fc.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        b = self.bnneck(f)
        return (self.fc(b), f) if self.training else b


def hard_mining_triplet(f, y, margin=0.3):
    d = torch.cdist(f, f)
    same = y[:, None] == y[None]
    ap = d.masked_fill(~same, 0).amax(1)
    an = d.masked_fill(same, 1e6).amin(1)
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def extract(net, recs, tf, rank, world, device):
    """Embed every world-th record on this rank and gather (features, pids, cams) from all ranks."""
    net.eval()
    shard = Subset(Recs(recs, tf), list(range(rank, len(recs), world)))
    feats, pids, cams = [], [], []
    for x, pid, cam in DataLoader(shard, batch_size=256, num_workers=6, pin_memory=True):
        feats.append(F.normalize(net(x.to(device, non_blocking=True)), dim=1))
        pids.append(pid.to(device))
        cams.append(cam.to(device))
    local = [torch.cat(feats), torch.cat(pids), torch.cat(cams)]
    gathered = []
    for t in local:
        buf = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf))
    return gathered


def evaluate(qf, qp, qc, gf, gp, gc):
    qp, qc, gp, gc = (t.cpu().numpy() for t in (qp, qc, gp, gc))
    aps, cmc, nv = [], np.zeros(20), 0
    for s in range(0, qf.size(0), 1024):
        sim = (qf[s:s + 1024] @ gf.t()).cpu().numpy()
        for j in range(sim.shape[0]):
            i = s + j
            o = np.argsort(-sim[j])
            m = gp[o][(gp[o] != qp[i]) | (gc[o] != qc[i])] == qp[i]
            if not m.any():
                continue
            nv += 1
            h = np.flatnonzero(m)
            aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
            if h[0] < 20:
                cmc[h[0]:] += 1
    return float(np.mean(aps)), cmc / nv


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    train = read_msmt(args.root, "list_train.txt", "train") + read_msmt(args.root, "list_val.txt", "train")
    query = read_msmt(args.root, "list_query.txt", "test")
    gallery = read_msmt(args.root, "list_gallery.txt", "test")
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])

    sampler = DistributedPKSampler(train, args.batch, args.k, rank, world)
    loader = DataLoader(Recs(train, tf), batch_size=args.batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(Model(len({r[1] for r in train}))).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: (e + 1) / 5 if e < 5 else 0.1 ** sum(e >= m for m in (30, 50)))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x)
            l_id, l_tri = ce(logits, y), hard_mining_triplet(feat, y)
            opt.zero_grad(set_to_none=True)
            (l_id + l_tri).backward()
            opt.step()
            tot += torch.stack([l_id.detach(), l_tri.detach(), torch.ones_like(l_id)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch + 1}: id {tot[0] / tot[2]:.3f} tri {tot[1] / tot[2]:.3f} {time.time() - t0:.0f}s",
                  flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            qf, qp, qc = extract(net, query, test_tf, rank, world, device)
            gf, gp, gc = extract(net, gallery, test_tf, rank, world, device)
            if rank == 0:
                mAP, cmc = evaluate(qf, qp, qc, gf, gp, gc)
                print(f"  mAP {100 * mAP:.2f} R1 {100 * cmc[0]:.2f} R5 {100 * cmc[4]:.2f} R10 {100 * cmc[9]:.2f}",
                      flush=True)
                torch.save({"model": net.state_dict(), "epoch": epoch + 1},
                           osp.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
