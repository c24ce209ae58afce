#!/usr/bin/env python
"""Strong re-ID baseline (ResNet-50, BNNeck, ID + triplet loss) with multi-GPU training.

    torchrun --nproc_per_node=4 01_reid_pk_sampler.py --data-root /datasets/Market-1501-v15.09.15 \
        --output runs/market_r50_bnneck
"""
import argparse
import copy
import logging
import os
import os.path as osp
import random
import re
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

logger = logging.getLogger("reid")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--output", default="runs/reid")
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--ims-per-gpu", type=int, default=64)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--base-lr", type=float, default=3.5e-4)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--eval-period", type=int, default=20)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def parse_market(dir_path, relabel=False):
    pattern = re.compile(r"([-\d]+)_c(\d)")
    files = sorted(f for f in os.listdir(dir_path) if f.endswith(".jpg"))
    items, pid_set = [], set()
    for f in files:
        pid, cam = map(int, pattern.search(f).groups())
        if pid == -1:  # junk images
            continue
        pid_set.add(pid)
        items.append((osp.join(dir_path, f), pid, cam - 1))
    if relabel:
        pid2label = {pid: i for i, pid in enumerate(sorted(pid_set))}
        items = [(path, pid2label[pid], cam) for path, pid, cam in items]
    return items


class ReIDDataset(Dataset):
    def __init__(self, items, transform):
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        img = Image.open(path).convert("RGB")
        return self.transform(img), pid, cam


class DistributedRandomIdentitySampler(Sampler):
    """Samples P identities x K instances for every batch; identities are split between ranks."""

    def __init__(self, data_source, batch_size, num_instances, rank, world_size, seed=0):
        self.num_instances = num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.seed = seed
        self.epoch = 0
        self.index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(data_source):
            self.index_dic[pid].append(index)
        self.pids = sorted(self.index_dic.keys())[rank::world_size]

        self.length = 0
        for pid in self.pids:
            num = max(len(self.index_dic[pid]), self.num_instances)
            self.length += num - num % self.num_instances

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        batch_idxs_dict = defaultdict(list)
        for pid in self.pids:
            idxs = copy.deepcopy(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = rng.choices(idxs, k=self.num_instances)
            rng.shuffle(idxs)
            chunk = []
            for idx in idxs:
                chunk.append(idx)
                if len(chunk) == self.num_instances:
                    batch_idxs_dict[pid].append(chunk)
                    chunk = []

        avai_pids = list(self.pids)
        final_idxs = []
        while len(avai_pids) >= self.num_pids_per_batch:
            selected = rng.sample(avai_pids, self.num_pids_per_batch)
            for pid in selected:
                final_idxs.extend(batch_idxs_dict[pid].pop(0))
                if len(batch_idxs_dict[pid]) == 0:
                    avai_pids.remove(pid)
        return iter(final_idxs)

    def __len__(self):
        return self.length


class Baseline(nn.Module):
    def __init__(self, num_classes, last_stride=1):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        if last_stride == 1:
            resnet.layer4[0].conv2.stride = (1, 1)
            resnet.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = self.gap(self.backbone(x)).flatten(1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


def triplet_hard(feat, labels, margin):
    dist_mat = torch.cdist(feat, feat)
    is_pos = labels.unsqueeze(0) == labels.unsqueeze(1)
    dist_ap = (dist_mat * is_pos.float()).max(dim=1).values
    dist_an = (dist_mat + 1e6 * is_pos.float()).min(dim=1).values
    return F.margin_ranking_loss(dist_an, dist_ap, torch.ones_like(dist_an), margin=margin)


@torch.no_grad()
def extract(model, loader, device):
    feats, pids, cams = [], [], []
    for img, pid, cam in loader:
        f = model(img.to(device, non_blocking=True))
        f = f + model(torch.flip(img, dims=[3]).to(device, non_blocking=True))
        feats.append(F.normalize(f, dim=1).cpu())
        pids.append(pid)
        cams.append(cam)
    return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()


def eval_market(distmat, q_pids, g_pids, q_cams, g_cams, max_rank=50):
    indices = np.argsort(distmat, axis=1)
    matches = (g_pids[indices] == q_pids[:, None]).astype(np.int32)
    all_cmc, all_ap = [], []
    for q in range(distmat.shape[0]):
        order = indices[q]
        keep = ~((g_pids[order] == q_pids[q]) & (g_cams[order] == q_cams[q]))
        raw = matches[q][keep]
        if not raw.any():
            continue
        cmc = raw.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        num_rel = raw.sum()
        tmp = raw.cumsum() / (np.arange(len(raw)) + 1.0)
        all_ap.append((tmp * raw).sum() / num_rel)
    return np.asarray(all_cmc).astype(np.float32).mean(0), float(np.mean(all_ap))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_items = parse_market(osp.join(args.data_root, "bounding_box_train"), relabel=True)
    query_items = parse_market(osp.join(args.data_root, "query"))
    gallery_items = parse_market(osp.join(args.data_root, "bounding_box_test"))
    num_classes = len({pid for _, pid, _ in train_items})

    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
        T.ToTensor(), normalize, T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406]),
    ])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC),
                         T.ToTensor(), normalize])

    train_set = ReIDDataset(train_items, train_tf)
    sampler = DistributedRandomIdentitySampler(train_items, args.ims_per_gpu, args.num_instances,
                                               rank, world_size, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.ims_per_gpu, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)

    model = Baseline(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    # lr is given for a batch of 64 images
    lr = args.base_lr * args.ims_per_gpu * world_size / 64
    params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=args.weight_decay)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
    decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 90], gamma=0.1)
    scheduler = torch.optim.lr_scheduler.ChainedScheduler([warmup, decay])
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    os.makedirs(args.output, exist_ok=True)
    best_map = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for it, (img, pid, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            pid = pid.to(device, non_blocking=True)
            logits, feat = model(img)
            loss_id = ce(logits, pid)
            loss_tri = triplet_hard(feat, pid, args.margin)
            loss = loss_id + loss_tri
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss_id.detach(), loss_tri.detach()])
            if it % 50 == 0 and rank == 0:
                logger.info("epoch %d it %d id %.3f tri %.3f", epoch, it, loss_id.item(), loss_tri.item())
        scheduler.step()
        dist.all_reduce(loss_sum)
        if rank == 0:
            n = max(it + 1, 1) * world_size
            logger.info("epoch %d done in %.1fs, mean id %.3f tri %.3f", epoch, time.time() - t0,
                        loss_sum[0].item() / n, loss_sum[1].item() / n)

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                net = model.module
                net.eval()
                q_loader = DataLoader(ReIDDataset(query_items, test_tf), batch_size=256, num_workers=8)
                g_loader = DataLoader(ReIDDataset(gallery_items, test_tf), batch_size=256, num_workers=8)
                qf, q_pids, q_cams = extract(net, q_loader, device)
                gf, g_pids, g_cams = extract(net, g_loader, device)
                distmat = (2 - 2 * qf @ gf.t()).numpy()
                cmc, mAP = eval_market(distmat, q_pids, g_pids, q_cams, g_cams)
                logger.info("epoch %d: mAP %.2f rank-1 %.2f rank-5 %.2f", epoch, 100 * mAP,
                            100 * cmc[0], 100 * cmc[4])
                state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "mAP": mAP}
                torch.save(state, osp.join(args.output, "last.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(state, osp.join(args.output, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
