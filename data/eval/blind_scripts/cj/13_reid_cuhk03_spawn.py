"""Single-node multi-GPU re-ID training on CUHK03-NP (detected), processes started with mp.spawn.

python 13_reid_cuhk03_spawn.py --root /data/cuhk03-np/detected --gpus 4
"""
import argparse
import glob
import os
import os.path as osp
import re
import socket
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/cuhk03-np/detected")
    p.add_argument("--out", default="runs/cuhk03_bnneck")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--pids-per-gpu", type=int, default=8)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--lr", type=float, default=3.5e-4, help="for a global batch of 64 images")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--resume", default="")
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scan(folder, relabel=False):
    pat = re.compile(r"([-\d]+)_c(\d)")
    data = [(f, *map(int, pat.search(osp.basename(f)).groups())) for f in sorted(glob.glob(osp.join(folder, "*.png")))]
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({d[1] for d in data}))}
        data = [(f, lut[pid], cam) for f, pid, cam in data]
    return data


class ReIDImages(Dataset):
    def __init__(self, data, transform):
        self.data, self.transform = data, transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        f, pid, cam = self.data[i]
        return self.transform(Image.open(f).convert("RGB")), pid, cam


class DistributedRandomIdentitySampler(Sampler):
    def __init__(self, data, pids_per_gpu, instances, rank, world_size, seed=0):
        self.P, self.K, self.rank, self.world, self.seed = pids_per_gpu, instances, rank, world_size, seed
        self.epoch = 0
        self.index = defaultdict(list)
        for i, (_, pid, _) in enumerate(data):
            self.index[pid].append(i)
        self.pids = sorted(self.index)
        self.iters = len(self.pids) // (self.P * self.world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # identical on every rank
        perm = torch.randperm(len(self.pids), generator=g).tolist()
        for it in range(self.iters):
            block = perm[it * self.P * self.world:(it + 1) * self.P * self.world]
            for j in block[self.rank * self.P:(self.rank + 1) * self.P]:
                idx = self.index[self.pids[j]]
                sel = torch.randint(len(idx), (self.K,), generator=g) if len(idx) < self.K \
                    else torch.randperm(len(idx), generator=g)[:self.K]
                yield from (idx[s] for s in sel.tolist())

    def __len__(self):
        return self.iters * self.P * self.K


class BNNeckNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        f = self.backbone(x).mean(dim=(2, 3))
        bn = self.bnneck(f)
        if not self.training:
            return bn
        return self.classifier(bn), f


def hard_triplet(f, y, margin=0.3):
    d = torch.cdist(f, f)
    same = y[:, None] == y[None]
    return F.relu(d.masked_fill(~same, -1).max(1)[0] - d.masked_fill(same, 1e9).min(1)[0] + margin).mean()


@torch.no_grad()
def evaluate(net, query, gallery, tf, device):
    net.eval()

    def feats(data):
        dl = DataLoader(ReIDImages(data, tf), batch_size=200, num_workers=4, pin_memory=True)
        return torch.cat([F.normalize(net(x.to(device)), dim=1) for x, _, _ in dl])

    qf, gf = feats(query), feats(gallery)
    dist_mat = torch.cdist(qf, gf).cpu().numpy()
    qp, qc = np.array([q[1] for q in query]), np.array([q[2] for q in query])
    gp, gc = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    aps, r1 = [], []
    for i in range(len(query)):
        o = np.argsort(dist_mat[i])
        ok = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        m = gp[o][ok] == qp[i]
        if m.any():
            r1.append(m[0])
            hit_pos = np.flatnonzero(m)
            aps.append(np.mean(np.arange(1, len(hit_pos) + 1) / (hit_pos + 1)))
    return float(np.mean(r1)), float(np.mean(aps))


def main_worker(gpu, ngpus, args, data):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu)
    device = torch.device("cuda", gpu)
    train, query, gallery, num_classes = data
    torch.manual_seed(0)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = DistributedRandomIdentitySampler(train, args.pids_per_gpu, args.instances, gpu, ngpus)
    loader = DataLoader(ReIDImages(train, train_tf), batch_size=args.pids_per_gpu * args.instances, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(BNNeckNet(num_classes)).to(device)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"]
    model = DDP(net, device_ids=[gpu])

    lr = args.lr * ngpus * args.pids_per_gpu * args.instances / 64
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [40, 70], 0.1)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    writer = SummaryWriter(args.out) if gpu == 0 else None

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (img, pid, _) in enumerate(loader):
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(img)
            loss = F.cross_entropy(logits, pid, label_smoothing=0.1) + hard_triplet(feat, pid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if it % 20 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                if writer:
                    writer.add_scalar("train/loss", avg.item() / ngpus, epoch * len(loader) + it)
        scheduler.step()

        if gpu == 0 and (epoch + 1) % 10 == 0:
            r1, mAP = evaluate(model.module, query, gallery, test_tf, device)
            writer.add_scalar("test/rank1", r1, epoch + 1)
            writer.add_scalar("test/mAP", mAP, epoch + 1)
            print(f"epoch {epoch + 1}: rank-1 {r1:.3f} mAP {mAP:.3f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                       osp.join(args.out, f"checkpoint_ep{epoch + 1}.pth"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


def main():
    args = parse_args()
    args.port = free_port()
    os.makedirs(args.out, exist_ok=True)
    # parse the folders once here; the lists are handed to every worker
    train = scan(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = scan(osp.join(args.root, "query"))
    gallery = scan(osp.join(args.root, "bounding_box_test"))
    num_classes = len({pid for _, pid, _ in train})
    print(f"{args.gpus} GPUs, {num_classes} training identities, {len(train)} images")
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args, (train, query, gallery, num_classes)))


if __name__ == "__main__":
    main()
