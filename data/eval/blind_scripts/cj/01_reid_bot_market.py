"""Bag-of-Tricks strong baseline for person re-ID on Market-1501, multi-GPU.

    torchrun --nproc_per_node=4 01_reid_bot_market.py --root /data/market1501
"""
import argparse
import glob
import logging
import os
import os.path as osp
import random
import re
import time
from collections import defaultdict
from datetime import timedelta

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

logger = logging.getLogger("reid")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/market1501")
    p.add_argument("--output-dir", default="./logs/bot_market")
    p.add_argument("--ims-per-batch", type=int, default=64, help="global P*K batch")
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--milestones", type=int, nargs="+", default=[40, 70])
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--eval-period", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


# ----------------------------------------------------------------------------- data
def read_market_dir(d, relabel=False):
    pattern = re.compile(r"([-\d]+)_c(\d)")
    items = []
    for path in sorted(glob.glob(osp.join(d, "*.jpg"))):
        pid, camid = map(int, pattern.search(path).groups())
        if pid == -1:
            continue
        items.append((path, pid, camid - 1))
    if relabel:
        pid2label = {pid: i for i, pid in enumerate(sorted({p for _, p, _ in items}))}
        items = [(path, pid2label[pid], cam) for path, pid, cam in items]
    return items


class ImageDataset(Dataset):
    def __init__(self, items, transform):
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, pid, camid = self.items[idx]
        img = Image.open(path).convert("RGB")
        return self.transform(img), pid, camid


class RandomIdentitySampler(Sampler):
    """Randomly samples P identities, then K instances of each identity."""

    def __init__(self, items, batch_size, num_instances):
        self.batch_size = batch_size
        self.num_instances = num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.index_dic = defaultdict(list)
        for idx, (_, pid, _) in enumerate(items):
            self.index_dic[pid].append(idx)
        self.pids = list(self.index_dic.keys())
        self.length = 0
        for pid in self.pids:
            n = max(len(self.index_dic[pid]), num_instances)
            self.length += n - n % num_instances

    def __iter__(self):
        batch_idxs_dict = defaultdict(list)
        for pid in self.pids:
            idxs = list(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = list(np.random.choice(idxs, size=self.num_instances, replace=True))
            random.shuffle(idxs)
            chunk = []
            for i in idxs:
                chunk.append(i)
                if len(chunk) == self.num_instances:
                    batch_idxs_dict[pid].append(chunk)
                    chunk = []
        avai_pids = list(self.pids)
        final_idxs = []
        while len(avai_pids) >= self.num_pids_per_batch:
            for pid in random.sample(avai_pids, self.num_pids_per_batch):
                final_idxs.extend(batch_idxs_dict[pid].pop(0))
                if not batch_idxs_dict[pid]:
                    avai_pids.remove(pid)
        return iter(final_idxs)

    def __len__(self):
        return self.length


# ----------------------------------------------------------------------------- model
class Baseline(nn.Module):
    in_planes = 2048

    def __init__(self, num_classes):
        super().__init__()
        resnet = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
        resnet.layer4[0].conv2.stride = (1, 1)
        resnet.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(resnet.children())[:-2])
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.bottleneck = nn.BatchNorm1d(self.in_planes)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(self.in_planes, num_classes, bias=False)
        nn.init.constant_(self.bottleneck.weight, 1.0)
        nn.init.constant_(self.bottleneck.bias, 0.0)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = self.gap(self.base(x)).flatten(1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


class CrossEntropyLabelSmooth(nn.Module):
    def __init__(self, num_classes, epsilon=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.epsilon = epsilon

    def forward(self, logits, targets):
        log_probs = F.log_softmax(logits, dim=1)
        targets = torch.zeros_like(log_probs).scatter_(1, targets.unsqueeze(1), 1)
        targets = (1 - self.epsilon) * targets + self.epsilon / self.num_classes
        return (-targets * log_probs).mean(0).sum()


def hard_triplet_loss(feats, labels, margin):
    dist_mat = torch.cdist(feats, feats).clamp(min=1e-12)
    is_pos = labels.unsqueeze(0).eq(labels.unsqueeze(1))
    dist_ap = dist_mat.masked_fill(~is_pos, float("-inf")).max(dim=1)[0]
    dist_an = dist_mat.masked_fill(is_pos, float("inf")).min(dim=1)[0]
    return F.margin_ranking_loss(dist_an, dist_ap, torch.ones_like(dist_an), margin=margin)


# ----------------------------------------------------------------------------- eval
def eval_market(distmat, q_pids, g_pids, q_camids, g_camids, max_rank=50):
    indices = np.argsort(distmat, axis=1)
    matches = (g_pids[indices] == q_pids[:, None]).astype(np.int32)
    all_cmc, all_ap = [], []
    for q in range(distmat.shape[0]):
        order = indices[q]
        keep = ~((g_pids[order] == q_pids[q]) & (g_camids[order] == q_camids[q]))
        raw_cmc = matches[q][keep]
        if not raw_cmc.any():
            continue
        cmc = raw_cmc.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        precision = raw_cmc.cumsum() / (np.arange(len(raw_cmc)) + 1.0)
        all_ap.append((precision * raw_cmc).sum() / raw_cmc.sum())
    return np.asarray(all_cmc, dtype=np.float32).mean(0), float(np.mean(all_ap))


@torch.no_grad()
def evaluate(model, loader, num_query, device):
    model.eval()
    feats, pids, camids = [], [], []
    for imgs, pid, camid in loader:
        imgs = imgs.to(device, non_blocking=True)
        f = model(imgs) + model(torch.flip(imgs, dims=[3]))
        feats.append(F.normalize(f, dim=1).cpu())
        pids.extend(pid.tolist())
        camids.extend(camid.tolist())
    feats = torch.cat(feats)
    pids, camids = np.asarray(pids), np.asarray(camids)
    qf, gf = feats[:num_query], feats[num_query:]
    distmat = torch.cdist(qf, gf).numpy()
    return eval_market(distmat, pids[:num_query], pids[num_query:], camids[:num_query], camids[num_query:])


def lr_factor(epoch, args):
    if epoch < args.warmup_epochs:
        return 0.01 + 0.99 * epoch / args.warmup_epochs
    return 0.1 ** sum(epoch >= m for m in args.milestones)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_items = read_market_dir(osp.join(args.root, "bounding_box_train"), relabel=True)
    query_items = read_market_dir(osp.join(args.root, "query"))
    gallery_items = read_market_dir(osp.join(args.root, "bounding_box_test"))
    num_classes = len({pid for _, pid, _ in train_items})

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
        T.ToTensor(), normalize, T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406]),
    ])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), normalize])

    batch_per_gpu = args.ims_per_batch // world_size
    train_loader = DataLoader(
        ImageDataset(train_items, train_tf), batch_size=batch_per_gpu,
        sampler=RandomIdentitySampler(train_items, batch_per_gpu, args.num_instances),
        num_workers=args.workers, pin_memory=True, drop_last=True,
    )
    test_loader = DataLoader(ImageDataset(query_items + gallery_items, test_tf), batch_size=256,
                             shuffle=False, num_workers=args.workers, pin_memory=True)

    model = Baseline(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_factor(e, args))
    id_criterion = CrossEntropyLabelSmooth(num_classes)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("train ids %d, images %d, world size %d", num_classes, len(train_items), world_size)

    best_map = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for it, (imgs, pids, _) in enumerate(train_loader):
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            logits, feats = model(imgs)
            loss = id_criterion(logits, pids) + hard_triplet_loss(feats, pids, args.margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        dist.all_reduce(loss_sum)
        logger.info("epoch %d loss %.4f lr %.2e time %.1fs", epoch + 1,
                    (loss_sum[0] / loss_sum[1]).item(), optimizer.param_groups[0]["lr"], time.time() - t0)

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                cmc, mAP = evaluate(model.module, test_loader, len(query_items), device)
                logger.info("epoch %d  mAP %.1f  rank-1 %.1f  rank-5 %.1f", epoch + 1,
                            100 * mAP, 100 * cmc[0], 100 * cmc[4])
                state = {"model": model.module.state_dict(), "epoch": epoch + 1, "mAP": mAP}
                torch.save(state, osp.join(args.output_dir, "last.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(state, osp.join(args.output_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
