# encoding: utf-8
"""
Bag-of-tricks re-ID baseline (warmup, random erasing, label smoothing,
last stride 1, BNNeck) on Market-1501, multi-GPU.

    torchrun --nproc_per_node=4 04_market_strong_baseline.py --config configs/market_r50.yml
"""
import argparse
import logging
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
import yaml
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50, ResNet50_Weights

DEFAULTS = {
    "DATA_ROOT": "/data/Market-1501-v15.09.15",
    "SIZE": [256, 128],
    "IMS_PER_BATCH": 64,          # total over all GPUs
    "NUM_INSTANCE": 4,
    "BASE_LR": 3.5e-4,
    "WEIGHT_DECAY": 5e-4,
    "MAX_EPOCHS": 120,
    "STEPS": [40, 70],
    "WARMUP_ITERS": 10,
    "MARGIN": 0.3,
    "EVAL_PERIOD": 10,
    "CHECKPOINT_PERIOD": 20,
    "NUM_WORKERS": 8,
    "OUTPUT_DIR": "./log/market_r50",
}


def setup_logger(name, save_dir, rank):
    log = logging.getLogger(name)
    log.setLevel(logging.DEBUG)
    if rank > 0:
        return log
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    log.addHandler(sh)
    os.makedirs(save_dir, exist_ok=True)
    fh = logging.FileHandler(osp.join(save_dir, "log.txt"), mode="a")
    fh.setFormatter(fmt)
    log.addHandler(fh)
    return log


class Market1501(object):
    pattern = re.compile(r"([-\d]+)_c(\d)")

    def __init__(self, root):
        self.train = self._process(osp.join(root, "bounding_box_train"), relabel=True)
        self.query = self._process(osp.join(root, "query"))
        self.gallery = self._process(osp.join(root, "bounding_box_test"))
        self.num_train_pids = len({pid for _, pid, _ in self.train})

    def _process(self, d, relabel=False):
        paths = sorted(glob(osp.join(d, "*.jpg")))
        pids = sorted({int(self.pattern.search(p).group(1)) for p in paths} - {-1})
        pid2label = {pid: i for i, pid in enumerate(pids)}
        out = []
        for p in paths:
            pid, cam = map(int, self.pattern.search(p).groups())
            if pid == -1:
                continue
            out.append((p, pid2label[pid] if relabel else pid, cam - 1))
        return out


class ImageDataset(Dataset):
    def __init__(self, dataset, transform=None):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        img_path, pid, camid = self.dataset[index]
        img = Image.open(img_path).convert("RGB")
        return self.transform(img), pid, camid


class RandomIdentitySampler_DDP(Sampler):
    def __init__(self, data_source, batch_size, num_instances, rank, world_size, seed=0):
        self.num_instances = num_instances
        self.mini_batch = batch_size // world_size
        self.num_pids_per_batch = self.mini_batch // num_instances
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = 0
        self.index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(data_source):
            self.index_dic[pid].append(index)
        self.pids = sorted(self.index_dic.keys())
        n = sum(max(len(v), num_instances) // num_instances * num_instances for v in self.index_dic.values())
        self.length = n // batch_size * self.mini_batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            idxs = list(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = list(rng.choice(idxs, size=self.num_instances, replace=True))
            rng.shuffle(idxs)
            chunks[pid] = [idxs[i:i + self.num_instances] for i in range(0, len(idxs) // self.num_instances * self.num_instances, self.num_instances)]
        avai = list(self.pids)
        minibatches = []
        while len(avai) >= self.num_pids_per_batch:
            sel = rng.choice(len(avai), self.num_pids_per_batch, replace=False)
            mb = []
            for pid in [avai[j] for j in sel]:
                mb.extend(chunks[pid].pop(0))
                if len(chunks[pid]) == 0:
                    avai.remove(pid)
            minibatches.append(mb)
        n = min(len(minibatches) // self.world_size, self.length // self.mini_batch) * self.world_size
        for mb in minibatches[self.rank:n:self.world_size]:
            yield from mb

    def __len__(self):
        return self.length


class Baseline(nn.Module):
    in_planes = 2048

    def __init__(self, num_classes):
        super().__init__()
        base = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        base.layer4[0].conv2.stride = (1, 1)
        base.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(base.children())[:-2])
        self.bottleneck = nn.BatchNorm1d(self.in_planes)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(self.in_planes, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = F.adaptive_avg_pool2d(self.base(x), 1).view(x.size(0), -1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


class TripletLoss(object):
    def __init__(self, margin):
        self.ranking_loss = nn.MarginRankingLoss(margin=margin)

    def __call__(self, global_feat, labels):
        n = global_feat.size(0)
        dist = torch.pow(global_feat, 2).sum(dim=1, keepdim=True).expand(n, n)
        dist = dist + dist.t()
        dist = dist.addmm(global_feat, global_feat.t(), beta=1, alpha=-2).clamp(min=1e-12).sqrt()
        is_pos = labels.expand(n, n).eq(labels.expand(n, n).t())
        dist_ap, _ = torch.max(dist[is_pos].contiguous().view(n, -1), 1, keepdim=True)
        dist_an, _ = torch.min(dist[~is_pos].contiguous().view(n, -1), 1, keepdim=True)
        y = torch.ones_like(dist_an)
        return self.ranking_loss(dist_an, dist_ap, y)


def eval_func(distmat, q_pids, g_pids, q_camids, g_camids, max_rank=50):
    num_q, num_g = distmat.shape
    indices = np.argsort(distmat, axis=1)
    matches = (g_pids[indices] == q_pids[:, np.newaxis]).astype(np.int32)
    all_cmc, all_AP = [], []
    for q_idx in range(num_q):
        order = indices[q_idx]
        remove = (g_pids[order] == q_pids[q_idx]) & (g_camids[order] == q_camids[q_idx])
        orig_cmc = matches[q_idx][np.invert(remove)]
        if not np.any(orig_cmc):
            continue
        cmc = orig_cmc.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        tmp_cmc = orig_cmc.cumsum() / (np.arange(len(orig_cmc)) + 1.0) * orig_cmc
        all_AP.append(tmp_cmc.sum() / orig_cmc.sum())
    return np.asarray(all_cmc).astype(np.float32).mean(0), np.mean(all_AP)


@torch.no_grad()
def do_inference(model, val_loader, num_query):
    model.eval()
    feats, pids, camids = [], [], []
    for img, pid, camid in val_loader:
        feats.append(model(img.cuda(non_blocking=True)))
        pids.extend(np.asarray(pid))
        camids.extend(np.asarray(camid))
    feats = F.normalize(torch.cat(feats), dim=1)
    qf, gf = feats[:num_query], feats[num_query:]
    distmat = torch.cdist(qf, gf).pow(2).cpu().numpy()
    pids, camids = np.asarray(pids), np.asarray(camids)
    return eval_func(distmat, pids[:num_query], pids[num_query:], camids[:num_query], camids[num_query:])


def main():
    parser = argparse.ArgumentParser(description="ReID Baseline Training")
    parser.add_argument("--config", default="", help="path to config file")
    parser.add_argument("--local_rank", default=0, type=int)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    args = parser.parse_args()

    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for k, v in zip(args.opts[0::2], args.opts[1::2]):
        cfg[k] = type(cfg[k])(v) if k in cfg and not isinstance(cfg[k], list) else yaml.safe_load(v)

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logger = setup_logger("reid_baseline", cfg["OUTPUT_DIR"], rank)
    logger.info("Running with config:\n%s", yaml.safe_dump(cfg))

    seed = 1234
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    data = Market1501(cfg["DATA_ROOT"])
    h, w = cfg["SIZE"]
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((h, w)), T.RandomHorizontalFlip(p=0.5), T.Pad(10), T.RandomCrop((h, w)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406])])
    val_tf = T.Compose([T.Resize((h, w)), T.ToTensor(), norm])

    sampler = RandomIdentitySampler_DDP(data.train, cfg["IMS_PER_BATCH"], cfg["NUM_INSTANCE"], rank, world_size, seed)
    train_loader = DataLoader(ImageDataset(data.train, train_tf), batch_size=cfg["IMS_PER_BATCH"] // world_size,
                              sampler=sampler, num_workers=cfg["NUM_WORKERS"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(ImageDataset(data.query + data.gallery, val_tf), batch_size=256, shuffle=False,
                            num_workers=cfg["NUM_WORKERS"])

    model = Baseline(data.num_train_pids)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=cfg["BASE_LR"], weight_decay=cfg["WEIGHT_DECAY"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: (0.1 + 0.9 * e / cfg["WARMUP_ITERS"]) if e < cfg["WARMUP_ITERS"]
        else 0.1 ** sum(e >= s for s in cfg["STEPS"]))
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)
    triplet = TripletLoss(cfg["MARGIN"])

    logger.info("start training")
    for epoch in range(1, cfg["MAX_EPOCHS"] + 1):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        meter = torch.zeros(3).cuda()
        for n_iter, (img, target, _) in enumerate(train_loader):
            img, target = img.cuda(non_blocking=True), target.cuda(non_blocking=True)
            score, feat = model(img)
            loss = xent(score, target) + triplet(feat, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            acc = (score.max(1)[1] == target).float().mean()
            meter += torch.stack([loss.detach(), acc, torch.ones_like(acc)])
            if (n_iter + 1) % 50 == 0:
                logger.info("Epoch[%d] Iter[%d/%d] Loss: %.3f, Acc: %.3f, Base Lr: %.2e", epoch, n_iter + 1,
                            len(train_loader), meter[0] / meter[2], meter[1] / meter[2], scheduler.get_last_lr()[0])
        scheduler.step()
        dist.all_reduce(meter)
        logger.info("Epoch %d done. loss %.3f acc %.3f time %.1fs", epoch, meter[0] / meter[2],
                    meter[1] / meter[2], time.time() - start)

        if rank == 0 and epoch % cfg["CHECKPOINT_PERIOD"] == 0:
            torch.save(model.module.state_dict(), osp.join(cfg["OUTPUT_DIR"], f"resnet50_{epoch}.pth"))
        if epoch % cfg["EVAL_PERIOD"] == 0:
            if rank == 0:
                cmc, mAP = do_inference(model.module, val_loader, len(data.query))
                logger.info("Validation Results - Epoch: %d  mAP: %.1f%%", epoch, mAP * 100)
                for r in [1, 5, 10]:
                    logger.info("CMC curve, Rank-%-3d:%.1f%%", r, cmc[r - 1] * 100)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
