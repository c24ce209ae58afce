"""
ResNet50 + BNNeck re-ID baseline on Market-1501, one process per GPU.

    python 01_spawn_market_bnneck.py --root /data/Market-1501-v15.09.15 --gpus 4
"""
import argparse
import glob
import os
import os.path as osp
import random
import re
import time
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler


def parse_args():
    p = argparse.ArgumentParser("market1501 bnneck")
    p.add_argument("--root", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=str, default="29512")
    p.add_argument("--ims-per-batch", type=int, default=64, help="global batch, P x K")
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--steps", type=int, nargs="+", default=[40, 70])
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--eval-period", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--output", default="logs/market_bnneck")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


# ---------------------------------------------------------------- data
PATTERN = re.compile(r"([-\d]+)_c(\d)")


def process_dir(dir_path, relabel=False):
    img_paths = sorted(glob.glob(osp.join(dir_path, "*.jpg")))
    pid_container = set()
    for path in img_paths:
        pid, _ = map(int, PATTERN.search(path).groups())
        if pid == -1:
            continue
        pid_container.add(pid)
    pid2label = {pid: label for label, pid in enumerate(sorted(pid_container))}
    data = []
    for path in img_paths:
        pid, camid = map(int, PATTERN.search(path).groups())
        if pid == -1:
            continue  # junk images
        camid -= 1
        if relabel:
            pid = pid2label[pid]
        data.append((path, pid, camid))
    return data


class ImageDataset(Dataset):
    def __init__(self, items, transform):
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, pid, camid = self.items[index]
        img = Image.open(path).convert("RGB")
        return self.transform(img), pid, camid


class DistributedIdentitySampler(Sampler):
    """P identities x K images per global batch. All ranks build the same
    global order from (seed, epoch) and each keeps its own slice of every batch."""

    def __init__(self, data_source, global_batch, num_instances, num_replicas, rank, seed=0):
        assert global_batch % (num_instances * num_replicas) == 0
        self.num_instances = num_instances
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.global_batch = global_batch
        self.local_batch = global_batch // num_replicas
        self.num_pids_per_batch = global_batch // num_instances
        self.index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(data_source):
            self.index_dic[pid].append(index)
        self.pids = sorted(self.index_dic.keys())
        total = 0
        for pid in self.pids:
            num = max(len(self.index_dic[pid]), num_instances)
            total += num - num % num_instances
        self.num_batches = total // global_batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            idxs = list(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = [rng.choice(idxs) for _ in range(self.num_instances)]
            rng.shuffle(idxs)
            chunks[pid] = [idxs[i:i + self.num_instances]
                           for i in range(0, len(idxs) - self.num_instances + 1, self.num_instances)]
        avai_pids = list(self.pids)
        order = []
        while len(avai_pids) >= self.num_pids_per_batch:
            for pid in rng.sample(avai_pids, self.num_pids_per_batch):
                order.extend(chunks[pid].pop(0))
                if not chunks[pid]:
                    avai_pids.remove(pid)
        for b in range(min(len(order) // self.global_batch, self.num_batches)):
            start = b * self.global_batch + self.rank * self.local_batch
            yield from order[start:start + self.local_batch]

    def __len__(self):
        return self.num_batches * self.local_batch


# ---------------------------------------------------------------- model
class Baseline(nn.Module):
    def __init__(self, num_classes, last_stride=1):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        if last_stride == 1:
            resnet.layer4[0].conv2.stride = (1, 1)
            resnet.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(resnet.children())[:-2])
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.constant_(self.bottleneck.weight, 1.0)
        nn.init.constant_(self.bottleneck.bias, 0.0)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = self.gap(self.base(x)).flatten(1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


def euclidean_dist(x, y):
    xx = x.pow(2).sum(1, keepdim=True)
    yy = y.pow(2).sum(1, keepdim=True).t()
    dist = xx + yy - 2 * x @ y.t()
    return dist.clamp(min=1e-12).sqrt()


class TripletLoss(nn.Module):
    def __init__(self, margin):
        super().__init__()
        self.ranking_loss = nn.MarginRankingLoss(margin=margin)

    def forward(self, feats, labels):
        dist = euclidean_dist(feats, feats)
        is_pos = labels.unsqueeze(0).eq(labels.unsqueeze(1))
        dist_ap = dist.masked_fill(~is_pos, 0).max(1)[0]
        dist_an = dist.masked_fill(is_pos, float("inf")).min(1)[0]
        return self.ranking_loss(dist_an, dist_ap, torch.ones_like(dist_an))


# ---------------------------------------------------------------- eval
def eval_func(distmat, q_pids, g_pids, q_camids, g_camids, max_rank=50):
    indices = np.argsort(distmat, axis=1)
    matches = (g_pids[indices] == q_pids[:, np.newaxis]).astype(np.int32)
    all_cmc, all_ap = [], []
    for q_idx in range(distmat.shape[0]):
        order = indices[q_idx]
        remove = (g_pids[order] == q_pids[q_idx]) & (g_camids[order] == q_camids[q_idx])
        raw_cmc = matches[q_idx][~remove]
        if not np.any(raw_cmc):
            continue
        cmc = raw_cmc.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        precision = raw_cmc.cumsum() / (np.arange(len(raw_cmc)) + 1.0)
        all_ap.append((precision * raw_cmc).sum() / raw_cmc.sum())
    cmc = np.asarray(all_cmc).astype(np.float32).mean(0)
    return cmc, float(np.mean(all_ap))


@torch.no_grad()
def evaluate(model, loader, num_query, device):
    model.eval()
    feats, pids, camids = [], [], []
    for imgs, pid, camid in loader:
        feats.append(model(imgs.to(device, non_blocking=True)))
        pids.extend(pid.tolist())
        camids.extend(camid.tolist())
    feats = F.normalize(torch.cat(feats), dim=1)
    pids, camids = np.asarray(pids), np.asarray(camids)
    qf, gf = feats[:num_query], feats[num_query:]
    distmat = (2 - 2 * qf @ gf.t()).cpu().numpy()
    return eval_func(distmat, pids[:num_query], pids[num_query:],
                     camids[:num_query], camids[num_query:])


# ---------------------------------------------------------------- train
def main_worker(gpu, args):
    rank, world_size = gpu, args.gpus
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)

    train = process_dir(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = process_dir(osp.join(args.root, "query"))
    gallery = process_dir(osp.join(args.root, "bounding_box_test"))
    num_classes = len({pid for _, pid, _ in train})

    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.Resize((args.height, args.width)), T.RandomHorizontalFlip(), T.Pad(10),
        T.RandomCrop((args.height, args.width)), T.ToTensor(), normalize,
        T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406]),
    ])
    test_tf = T.Compose([T.Resize((args.height, args.width)), T.ToTensor(), normalize])

    sampler = DistributedIdentitySampler(train, args.ims_per_batch, args.num_instances,
                                         world_size, rank, seed=args.seed)
    train_loader = DataLoader(ImageDataset(train, train_tf), batch_size=args.ims_per_batch // world_size,
                              sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(ImageDataset(query + gallery, test_tf), batch_size=256,
                             shuffle=False, num_workers=args.workers, pin_memory=True)

    model = Baseline(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[gpu], output_device=gpu)

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=args.lr, weight_decay=args.weight_decay)

    def lr_lambda(epoch):
        if epoch < args.warmup_epochs:
            return 0.01 + 0.99 * epoch / args.warmup_epochs
        return 0.1 ** sum(epoch >= s for s in args.steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)
    triplet = TripletLoss(args.margin)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"train ids {num_classes}, images {len(train)}, query {len(query)}, gallery {len(gallery)}")

    best_map = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        start = time.time()
        for imgs, pids, _ in train_loader:
            imgs = imgs.to(device, non_blocking=True)
            pids = pids.to(device, non_blocking=True)
            logits, feats = model(imgs)
            loss_id = xent(logits, pids)
            loss_tri = triplet(feats, pids)
            loss = loss_id + loss_tri
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss_id.detach(), loss_tri.detach()])
        scheduler.step()

        dist.all_reduce(loss_sum)
        loss_sum /= world_size * len(train_loader)
        if rank == 0:
            print(f"epoch {epoch + 1}: id {loss_sum[0]:.3f} tri {loss_sum[1]:.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - start:.0f}s")

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                cmc, mAP = evaluate(model.module, test_loader, len(query), device)
                print(f"  mAP {mAP:.1%} R1 {cmc[0]:.1%} R5 {cmc[4]:.1%} R10 {cmc[9]:.1%}")
                state = {"model": model.module.state_dict(), "epoch": epoch + 1, "mAP": mAP}
                torch.save(state, osp.join(args.output, "last.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(state, osp.join(args.output, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args))


if __name__ == "__main__":
    main()
