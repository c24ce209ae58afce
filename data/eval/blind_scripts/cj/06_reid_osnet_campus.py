"""OSNet re-ID on our campus camera crops.

Layout: <root>/<person_id>/<cam>_<frame>.jpg. A fixed number of identities is held out for
query/gallery evaluation, the rest is used for training.

torchrun --nproc_per_node=4 06_reid_osnet_campus.py --root /mnt/nas/campus_reid_v3 --out runs/osnet_campus
"""
import argparse
import os
import os.path as osp
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchreid
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/osnet_campus")
    ap.add_argument("--num-test-ids", type=int, default=300)
    ap.add_argument("--p", type=int, default=8, help="identities per GPU batch")
    ap.add_argument("--k", type=int, default=4, help="images per identity")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.0015, help="for a global batch of 128 images")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_identities(root, num_test_ids):
    pids = sorted(d for d in os.listdir(root) if osp.isdir(osp.join(root, d)))
    random.shuffle(pids)
    return sorted(pids[num_test_ids:]), sorted(pids[:num_test_ids])


def collect(root, pids, relabel):
    items = []
    for label, pid in enumerate(pids):
        for fname in sorted(os.listdir(osp.join(root, pid))):
            cam = int(fname.split("_")[0].lstrip("c"))
            items.append((osp.join(root, pid, fname), label if relabel else int(pid), cam))
    return items


def make_query_gallery(items, rng):
    by_pid_cam = defaultdict(list)
    for it in items:
        by_pid_cam[(it[1], it[2])].append(it)
    query, gallery = [], []
    for key in sorted(by_pid_cam):
        group = by_pid_cam[key]
        q = rng.randrange(len(group))
        query.append(group[q])
        gallery.extend(g for i, g in enumerate(group) if i != q)
    return query, gallery


class CropSet(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), pid, cam


class DistPKSampler(Sampler):
    def __init__(self, items, p, k, rank, world_size, seed=0):
        self.p, self.k, self.rank, self.world_size, self.seed = p, k, rank, world_size, seed
        self.epoch = 0
        self.by_pid = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.by_pid[pid].append(i)
        self.pids = sorted(self.by_pid)
        self.batches_per_rank = len(self.pids) // (p * world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = [self.pids[i] for i in torch.randperm(len(self.pids), generator=g).tolist()]
        step = self.p * self.world_size
        for b in range(self.batches_per_rank):
            chunk = order[b * step:(b + 1) * step][self.rank * self.p:(self.rank + 1) * self.p]
            for pid in chunk:
                idxs = self.by_pid[pid]
                pick = torch.randint(len(idxs), (self.k,), generator=g) if len(idxs) < self.k else \
                    torch.randperm(len(idxs), generator=g)[:self.k]
                yield from (idxs[j] for j in pick.tolist())

    def __len__(self):
        return self.batches_per_rank * self.p * self.k


def batch_hard_triplet(feats, pids, margin=0.3):
    d = torch.cdist(feats, feats)
    same = pids[:, None] == pids[None, :]
    hardest_pos = torch.where(same, d, torch.zeros_like(d)).max(1).values
    hardest_neg = torch.where(same, torch.full_like(d, 1e4), d).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


@torch.no_grad()
def evaluate(model, query, gallery, tf, device):
    model.eval()

    def feats_of(items):
        loader = DataLoader(CropSet(items, tf), batch_size=256, num_workers=8)
        out = [F.normalize(model(x.to(device)), dim=1).cpu() for x, _, _ in loader]
        return torch.cat(out)

    qf, gf = feats_of(query), feats_of(gallery)
    q_pids, g_pids = np.array([q[1] for q in query]), np.array([g[1] for g in gallery])
    q_cams, g_cams = np.array([q[2] for q in query]), np.array([g[2] for g in gallery])
    dist_mat = (2 - 2 * qf @ gf.t()).numpy()
    r1, aps = 0, []
    for i in range(len(query)):
        order = np.argsort(dist_mat[i])
        valid = ~((g_pids[order] == q_pids[i]) & (g_cams[order] == q_cams[i]))
        match = (g_pids[order][valid] == q_pids[i])
        if not match.any():
            continue
        r1 += int(match[0])
        hits = np.cumsum(match)
        aps.append(np.mean(hits[match] / (np.flatnonzero(match) + 1)))
    return r1 / len(aps), float(np.mean(aps))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # a different augmentation stream on every GPU
    set_seed(args.seed + rank)

    train_pids, test_pids = split_identities(args.root, args.num_test_ids)
    train_items = collect(args.root, train_pids, relabel=True)
    test_items = collect(args.root, test_pids, relabel=False)
    query, gallery = make_query_gallery(test_items, random.Random(0))

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.15, 0.1),
                          T.RandomResizedCrop((256, 128), scale=(0.7, 1.0)), T.ToTensor(), norm, T.RandomErasing()])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])

    sampler = DistPKSampler(train_items, args.p, args.k, rank, world_size, seed=args.seed)
    loader = DataLoader(CropSet(train_items, train_tf), batch_size=args.p * args.k, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    model = torchreid.models.build_model("osnet_x1_0", num_classes=len(train_pids), loss="triplet", pretrained=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * world_size * args.p * args.k / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        print(f"train ids {len(train_pids)} imgs {len(train_items)} | query {len(query)} gallery {len(gallery)}")

    best_map, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for imgs, pids, _ in loader:
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            logits, feats = model(imgs)
            ce = F.cross_entropy(logits, pids, label_smoothing=0.1)
            tri = batch_hard_triplet(feats, pids)
            loss = ce + tri
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 20 == 0:
                stats = torch.stack([ce.detach(), tri.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("loss/id", stats[0].item(), step)
                    writer.add_scalar("loss/triplet", stats[1].item(), step)
            step += 1
        scheduler.step()

        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch + 1 == args.epochs):
            r1, mAP = evaluate(model.module, query, gallery, test_tf, device)
            writer.add_scalar("eval/rank1", r1, epoch + 1)
            writer.add_scalar("eval/mAP", mAP, epoch + 1)
            print(f"epoch {epoch + 1}: rank-1 {r1:.2%} mAP {mAP:.2%}", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch + 1, "train_pids": train_pids}
            torch.save(ckpt, osp.join(args.out, "last.pth"))
            if mAP > best_map:
                best_map = mAP
                torch.save(ckpt, osp.join(args.out, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
