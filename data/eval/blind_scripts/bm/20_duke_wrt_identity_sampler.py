"""AGW-style re-ID baseline on DukeMTMC-reID: ResNet-50 + GeM + BNNeck,
label-smoothed ID loss + weighted regularized triplet (WRT).

    torchrun --nproc_per_node=4 20_duke_wrt_identity_sampler.py --root /data/DukeMTMC-reID
"""
import argparse
import copy
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
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
import torchvision.transforms as T


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/DukeMTMC-reID")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU, P*K")
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--eval-step", type=int, default=20)
    p.add_argument("--output", default="./log/duke_agw")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def process_dir(path, relabel=False):
    rows = []
    for img in sorted(glob(osp.join(path, "*.jpg"))):
        pid, camid = map(int, re.search(r"([-\d]+)_c(\d)", img).groups())
        rows.append((img, pid, camid - 1))
    if relabel:
        mapping = {pid: lab for lab, pid in enumerate(sorted({r[1] for r in rows}))}
        rows = [(img, mapping[pid], cam) for img, pid, cam in rows]
    return rows


class ReIDSet(Dataset):
    def __init__(self, rows, transform):
        self.rows, self.transform = rows, transform

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        img, pid, cam = self.rows[i]
        return self.transform(Image.open(img).convert("RGB")), pid, cam


class DistributedRandomIdentitySampler(Sampler):
    """RandomIdentitySampler where every GPU draws from its own share of the identities."""

    def __init__(self, rows, batch_size, num_instances, rank, world_size, seed=0):
        self.batch_size, self.num_instances = batch_size, num_instances
        self.num_pids_per_batch = batch_size // num_instances
        index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(rows):
            index_dic[pid].append(index)
        all_pids = sorted(index_dic)
        self.pids = all_pids[rank::world_size]
        self.index_dic = {pid: index_dic[pid] for pid in self.pids}
        self.seed, self.epoch, self.rank = seed, 0, rank
        self.length = 0
        for pid in self.pids:
            num = max(len(self.index_dic[pid]), num_instances)
            self.length += num - num % num_instances

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rnd = random.Random(self.seed + self.epoch * 100 + self.rank)
        batch_idxs_dict = defaultdict(list)
        for pid in self.pids:
            idxs = copy.deepcopy(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = [rnd.choice(idxs) for _ in range(self.num_instances)]
            rnd.shuffle(idxs)
            batch = []
            for idx in idxs:
                batch.append(idx)
                if len(batch) == self.num_instances:
                    batch_idxs_dict[pid].append(batch)
                    batch = []
        avai_pids = copy.deepcopy(self.pids)
        final_idxs = []
        while len(avai_pids) >= self.num_pids_per_batch:
            for pid in rnd.sample(avai_pids, self.num_pids_per_batch):
                final_idxs.extend(batch_idxs_dict[pid].pop(0))
                if len(batch_idxs_dict[pid]) == 0:
                    avai_pids.remove(pid)
        return iter(final_idxs)

    def __len__(self):
        return self.length


class GeM(nn.Module):
    def __init__(self, p=3.0):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)

    def forward(self, x):
        return F.adaptive_avg_pool2d(x.clamp(min=1e-6).pow(self.p), 1).pow(1.0 / self.p).flatten(1)


class AGW(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.pool = GeM()
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        gf = self.pool(self.base(x))
        feat = self.bottleneck(gf)
        return (self.classifier(feat), gf) if self.training else feat


def wrt_loss(feats, pids):
    d = torch.cdist(feats, feats)
    is_pos = (pids[:, None] == pids[None, :]).float()
    is_neg = 1.0 - is_pos
    dist_ap, dist_an = d * is_pos, d * is_neg
    w_ap = F.softmax(dist_ap.masked_fill(is_pos == 0, -1e9), dim=1)
    w_an = F.softmax((-dist_an).masked_fill(is_neg == 0, -1e9), dim=1)
    closest_neg = (dist_an * w_an).sum(1)
    furthest_pos = (dist_ap * w_ap).sum(1)
    return F.softplus(furthest_pos - closest_neg).mean()


@torch.no_grad()
def evaluate(model, q_rows, g_rows, tf, device):
    model.eval()
    def feats(rows):
        loader = DataLoader(ReIDSet(rows, tf), batch_size=256, num_workers=8)
        return torch.cat([F.normalize(model(x.to(device))).cpu() for x, _, _ in loader])
    qf, gf = feats(q_rows), feats(g_rows)
    model.train()
    qp, qc = np.array([r[1] for r in q_rows]), np.array([r[2] for r in q_rows])
    gp, gc = np.array([r[1] for r in g_rows]), np.array([r[2] for r in g_rows])
    order = torch.argsort(qf @ gf.t(), dim=1, descending=True).numpy()
    aps, r1 = [], []
    for i in range(len(qp)):
        o = order[i]
        good = (gp[o] == qp[i])[~((gp[o] == qp[i]) & (gc[o] == qc[i]))]
        if not good.any():
            continue
        r1.append(good[0])
        pos = np.flatnonzero(good)
        aps.append(np.mean(np.arange(1, len(pos) + 1) / (pos + 1)))
    return float(np.mean(aps)), float(np.mean(r1))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406])])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    train = process_dir(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = process_dir(osp.join(args.root, "query"))
    gallery = process_dir(osp.join(args.root, "bounding_box_test"))
    num_classes = len({r[1] for r in train})

    sampler = DistributedRandomIdentitySampler(train, args.batch_size, args.num_instances, rank, world, args.seed)
    loader = DataLoader(ReIDSet(train, train_tf), batch_size=args.batch_size, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AGW(num_classes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 70], gamma=0.1)
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    os.makedirs(args.output, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        if epoch < 10:
            for g in optimizer.param_groups:
                g["lr"] = args.lr * (epoch + 1) / 10
        t0 = time.time()
        for it, (imgs, pids, _) in enumerate(loader):
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            score, feat = model(imgs)
            loss = xent(score, pids) + wrt_loss(feat, pids)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and (it + 1) % 50 == 0:
                acc = (score.argmax(1) == pids).float().mean()
                print(f"Epoch[{epoch}] Iter[{it + 1}/{len(loader)}] loss {loss.item():.3f} acc {acc:.3f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)
        if epoch >= 10:
            scheduler.step()

        if (epoch + 1) % args.eval_step == 0:
            if rank == 0:
                mAP, r1 = evaluate(model.module, query, gallery, test_tf, device)
                print(f"Validation epoch {epoch + 1}: mAP {mAP:.1%} Rank-1 {r1:.1%}", flush=True)
                if mAP > best:
                    best = mAP
                    torch.save(model.module.state_dict(), osp.join(args.output, "best_model.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
