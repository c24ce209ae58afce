"""
ViT-B/16 re-ID baseline (TransReID-style: overlapping patches off, BNNeck on the
CLS token, ID + triplet), MSMT17, fp16.

    torchrun --nproc_per_node=8 15_msmt_vit_transreid.py --root /data/MSMT17_V1 --out logs/msmt_vit
"""
import argparse
import logging
import math
import os
import os.path as osp
import random
import time
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

logger = logging.getLogger("transreid")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="logs/msmt_vit")
    ap.add_argument("--ims-per-batch", type=int, default=64)
    ap.add_argument("--num-instance", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=0.008)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--eval-period", type=int, default=20)
    ap.add_argument("--log-period", type=int, default=50)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def msmt_list(root, list_name, sub):
    out = []
    with open(osp.join(root, list_name)) as f:
        for line in f:
            rel, pid = line.strip().split(" ")
            cam = int(osp.basename(rel).split("_")[2]) - 1
            out.append((osp.join(root, sub, rel), int(pid), cam))
    return out


class ImgSet(Dataset):
    def __init__(self, data, tf):
        self.data, self.tf = data, tf

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        p, pid, cam = self.data[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class RandomIdentitySamplerDDP(Sampler):
    def __init__(self, data, batch_size, num_instances, rank, world, seed=0):
        self.N, self.k = batch_size, num_instances
        self.rank, self.world, self.seed = rank, world, seed
        self.mini = batch_size // world
        self.epoch = 0
        self.by_pid = defaultdict(list)
        for i, (_, pid, _) in enumerate(data):
            self.by_pid[pid].append(i)
        self.pids = sorted(self.by_pid)
        self.n_batches = sum(max(len(v), num_instances) // num_instances for v in self.by_pid.values()) \
            * num_instances // batch_size

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.n_batches * self.mini

    def __iter__(self):
        rnd = random.Random(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            v = list(self.by_pid[pid])
            if len(v) < self.k:
                v = [rnd.choice(v) for _ in range(self.k)]
            rnd.shuffle(v)
            chunks[pid] = [v[i:i + self.k] for i in range(0, len(v) // self.k * self.k, self.k)]
        avail, stream = list(self.pids), []
        while len(avail) >= self.N // self.k and len(stream) < self.n_batches * self.N:
            for pid in rnd.sample(avail, self.N // self.k):
                stream += chunks[pid].pop(0)
                if not chunks[pid]:
                    avail.remove(pid)
        for b in range(len(stream) // self.N):
            yield from stream[b * self.N + self.rank * self.mini:b * self.N + (self.rank + 1) * self.mini]


class ViTReID(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224.augreg_in21k_ft_in1k", pretrained=True,
                                     img_size=(256, 128), num_classes=0, drop_path_rate=0.1)
        dim = self.vit.num_features
        self.bottleneck = nn.BatchNorm1d(dim)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(dim, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        cls = self.vit(x)
        feat = self.bottleneck(cls)
        if self.training:
            return self.classifier(feat), cls
        return feat


def triplet_loss(f, y, margin=0.3):
    f = f.float()
    d = torch.cdist(f, f)
    pos = y[:, None] == y[None]
    return F.relu(d.masked_fill(~pos, 0).amax(1) - d.masked_fill(pos, 1e6).amin(1) + margin).mean()


def r1_map(dm, qp, gp, qc, gc):
    order = np.argsort(dm, 1)
    aps, cmc = [], []
    for i in range(dm.shape[0]):
        o = order[i]
        keep = (gp[o] != qp[i]) | (gc[o] != qc[i])
        m = (gp[o][keep] == qp[i]).astype(np.float64)
        if m.sum() == 0:
            continue
        cmc.append(np.minimum(m.cumsum(), 1)[:10])
        aps.append((m.cumsum() / np.arange(1, len(m) + 1) * m).sum() / m.sum())
    return np.mean(cmc, 0), float(np.mean(aps))


@torch.no_grad()
def validate(net, query, gallery, tf, device):
    net.eval()
    loader = DataLoader(ImgSet(query + gallery, tf), batch_size=256, num_workers=8, pin_memory=True)
    feats = []
    for x, _, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats.append(net(x.to(device, non_blocking=True)).float())
    feats = F.normalize(torch.cat(feats), dim=1)
    nq = len(query)
    dm = torch.cdist(feats[:nq], feats[nq:]).cpu().numpy()
    a = lambda L, j: np.array([t[j] for t in L])
    return r1_map(dm, a(query, 1), a(gallery, 1), a(query, 2), a(gallery, 2))


def make_optimizer(net, base_lr):
    groups = []
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        lr, wd = base_lr, 1e-4
        if "classifier" in name:
            lr = base_lr * 2
        if p.ndim == 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name:
            wd = 0.0
        groups.append({"params": [p], "lr": lr, "weight_decay": wd})
    return torch.optim.SGD(groups, momentum=0.9)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s transreid %(levelname)s: %(message)s")
    torch.manual_seed(1234)

    train = msmt_list(args.root, "list_train.txt", "train") + msmt_list(args.root, "list_val.txt", "train")
    query = msmt_list(args.root, "list_query.txt", "test")
    gallery = msmt_list(args.root, "list_gallery.txt", "test")
    num_classes = len({t[1] for t in train})

    norm = T.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    train_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                          T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), norm])
    sampler = RandomIdentitySamplerDDP(train, args.ims_per_batch, args.num_instance, rank, world)
    loader = DataLoader(ImgSet(train, train_tf), batch_size=args.ims_per_batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ViTReID(num_classes)).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = make_optimizer(net, args.base_lr)
    total, warm = args.epochs * len(loader), args.warmup_epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: max(0.01, s / warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("MSMT17: %d ids, %d train, %d query, %d gallery", num_classes, len(train), len(query),
                    len(gallery))

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for it, (img, pid, _) in enumerate(loader):
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                score, feat = model(img)
                loss_id = ce(score, pid)
            loss = loss_id + triplet_loss(feat, pid)
            if not torch.isfinite(loss):
                logger.warning("non-finite loss at epoch %d iter %d, skipping batch", epoch, it)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            meter += torch.stack([loss.detach(), (score.argmax(1) == pid).float().mean(), torch.ones_like(loss)])
            if rank == 0 and (it + 1) % args.log_period == 0:
                logger.info("Epoch[%d] Iteration[%d/%d] Loss: %.3f Acc: %.3f Lr: %.2e", epoch, it + 1, len(loader),
                            meter[0] / meter[2], meter[1] / meter[2], scheduler.get_last_lr()[0])
        dist.all_reduce(meter)
        logger.info("Epoch %d done: loss %.3f acc %.3f, %.1fs", epoch, meter[0] / meter[2], meter[1] / meter[2],
                    time.time() - t0)

        if epoch % args.eval_period == 0 or epoch == args.epochs:
            if rank == 0:
                cmc, mAP = validate(net, query, gallery, test_tf, device)
                logger.info("Validation epoch %d: mAP %.1f%%, Rank-1 %.1f%%, Rank-5 %.1f%%", epoch, 100 * mAP,
                            100 * cmc[0], 100 * cmc[4])
                torch.save(net.state_dict(), osp.join(args.out, f"transformer_{epoch}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
