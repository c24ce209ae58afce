"""Person re-ID on MSMT17 with a ResNet-50 (last stride 1) + BNNeck, ID loss + batch-hard triplet.

    torchrun --nproc_per_node=4 19_reid_msmt_bnneck.py --root /data/MSMT17_V1 --out logs/msmt17_r50
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
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ims-per-batch", type=int, default=256, help="global batch")
    ap.add_argument("--num-instance", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3.5e-4, help="for the global batch of 256")
    ap.add_argument("--max-epoch", type=int, default=60)
    ap.add_argument("--iters-per-epoch", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def read_msmt_list(root, list_name, img_dir):
    items = []
    with open(osp.join(root, list_name)) as f:
        for line in f:
            path, pid = line.split()
            cam = int(path.split("_")[2]) - 1
            items.append((osp.join(root, img_dir, path), int(pid), cam))
    return items


class ImageDataset(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pid, cam = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class BalancedIdentitySampler(Sampler):
    """Every rank draws the same global stream of P x K batches (same seed) and keeps its own slice,
    so all ranks run the same number of iterations."""

    def __init__(self, pids, global_batch, num_instance, rank, world, iters, seed):
        self.pid_index = defaultdict(list)
        for i, pid in enumerate(pids):
            self.pid_index[pid].append(i)
        self.all_pids = sorted(self.pid_index)
        self.global_batch, self.k = global_batch, num_instance
        self.rank, self.world, self.iters, self.seed = rank, world, iters, seed
        self.local_batch = global_batch // world
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        p = self.global_batch // self.k
        for _ in range(self.iters):
            batch = []
            for pid in rng.choice(self.all_pids, size=p, replace=False):
                idxs = self.pid_index[pid]
                batch.extend(rng.choice(idxs, size=self.k, replace=len(idxs) < self.k).tolist())
            yield from batch[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]

    def __len__(self):
        return self.iters * self.local_batch


class ReIDNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
        base.layer4[0].conv2.stride = (1, 1)
        base.layer4[0].downsample[0].stride = (1, 1)
        self.base = base
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        b = self.base
        x = b.maxpool(b.relu(b.bn1(b.conv1(x))))
        x = b.layer4(b.layer3(b.layer2(b.layer1(x))))
        feat = F.adaptive_avg_pool2d(x, 1).flatten(1)
        bn_feat = self.neck(feat)
        if not self.training:
            return bn_feat
        return self.classifier(bn_feat), feat


def batch_hard_triplet(feat, pids, margin=0.3):
    d = torch.cdist(feat, feat)
    same = pids[:, None] == pids[None, :]
    ap = d.masked_fill(~same, -1).max(1).values
    an = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def extract(net, items, tf, device):
    loader = DataLoader(ImageDataset(items, tf), batch_size=256, num_workers=8)
    feats, pids, cams = [], [], []
    for img, pid, cam in loader:
        img = img.to(device)
        f = net(img) + net(img.flip(3))
        feats.append(F.normalize(f).cpu())
        pids.append(pid)
        cams.append(cam)
    return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()


def map_cmc(qf, q_pids, q_cams, gf, g_pids, g_cams, device, chunk=512):
    aps, r1 = [], []
    gf = gf.to(device)
    for start in range(0, len(qf), chunk):
        orders = torch.argsort(qf[start:start + chunk].to(device) @ gf.t(), dim=1, descending=True).cpu().numpy()
        for j, order in enumerate(orders):
            i = start + j
            valid = ~((g_pids[order] == q_pids[i]) & (g_cams[order] == q_cams[i]))
            match = (g_pids[order] == q_pids[i])[valid]
            if not match.any():
                continue
            r1.append(match[0])
            hits = np.cumsum(match)
            aps.append((hits[match] / (np.nonzero(match)[0] + 1)).mean())
    return float(np.mean(aps)), float(np.mean(r1))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train = read_msmt_list(args.root, "list_train.txt", "train") + read_msmt_list(args.root, "list_val.txt", "train")
    query = read_msmt_list(args.root, "list_query.txt", "test")
    gallery = read_msmt_list(args.root, "list_gallery.txt", "test")
    num_classes = len({pid for _, pid, _ in train})

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((384, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])

    sampler = BalancedIdentitySampler([pid for _, pid, _ in train], args.ims_per_batch, args.num_instance,
                                      rank, world, args.iters_per_epoch, args.seed)
    loader = DataLoader(ImageDataset(train, train_tf), batch_size=args.ims_per_batch // world, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    model = ReIDNet(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                 weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: (e + 1) / 10 if e < 10 else 0.5 * (1 + np.cos(np.pi * (e - 10) / (args.max_epoch - 10))))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    for epoch in range(args.max_epoch):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, pid, _) in enumerate(loader):
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(img)
            # triplet on this GPU's P x K slice
            loss = ce(logits, pid) + batch_hard_triplet(feat, pid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if it % 200 == 0 and rank == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)
        scheduler.step()

        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch + 1 == args.max_epoch):
            net = model.module.eval()
            qf, qp, qc = extract(net, query, test_tf, device)
            gf, gp, gc = extract(net, gallery, test_tf, device)
            mAP, r1 = map_cmc(qf, qp, qc, gf, gp, gc, device)
            print(f"epoch {epoch}: mAP {100 * mAP:.1f} R1 {100 * r1:.1f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(net.state_dict(), osp.join(args.out, f"model_{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
