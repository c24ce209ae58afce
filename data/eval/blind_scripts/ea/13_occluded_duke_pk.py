"""
Occluded-DukeMTMC training: ResNet50 + BNNeck with random occlusion
augmentation (paste a random background patch over the lower body).

    torchrun --nproc_per_node=4 13_occluded_duke_pk.py --root /data/Occluded_Duke --amp
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
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50, ResNet50_Weights

logger = logging.getLogger("occ_duke")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--ims-per-batch", type=int, default=64)
    p.add_argument("--num-instance", type=int, default=4)
    p.add_argument("--max-epoch", type=int, default=120)
    p.add_argument("--base-lr", type=float, default=3.5e-4)
    p.add_argument("--occ-prob", type=float, default=0.5)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--output-dir", default="logs/occ_duke")
    p.add_argument("--eval-period", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def load(folder, relabel=False):
    rx = re.compile(r"([-\d]+)_c(\d)")
    recs = []
    for p in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, rx.search(osp.basename(p)).groups())
        recs.append((p, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({r[1] for r in recs}))}
        recs = [(p, lut[pid], c) for p, pid, c in recs]
    return recs


class RandomOcclusion:
    """Paste a crop taken from another training image over the lower part."""

    def __init__(self, pool, prob):
        self.pool, self.prob = pool, prob

    def __call__(self, img):
        if random.random() > self.prob:
            return img
        w, h = img.size
        donor = Image.open(random.choice(self.pool)).convert("RGB").resize((w, h))
        oh = int(h * random.uniform(0.25, 0.5))
        patch = donor.crop((0, 0, w, oh))
        img = img.copy()
        img.paste(patch, (0, h - oh))
        return img


class ReIDSet(Dataset):
    def __init__(self, recs, tf):
        self.recs, self.tf = recs, tf

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        p, pid, cam = self.recs[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedRandomIdentitySampler(Sampler):
    def __init__(self, recs, batch_size, num_instances, world_size, rank, seed):
        self.batch_size, self.num_instances = batch_size, num_instances
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.mini = batch_size // world_size
        self.epoch = 0
        self.index_dic = defaultdict(list)
        for i, (_, pid, _) in enumerate(recs):
            self.index_dic[pid].append(i)
        self.pids = sorted(self.index_dic)
        n = sum(max(len(v), num_instances) // num_instances for v in self.index_dic.values())
        self.num_batches = n * num_instances // batch_size

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_batches * self.mini

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        per_pid = {}
        for pid in self.pids:
            idxs = np.asarray(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = rng.choice(idxs, self.num_instances, replace=True)
            rng.shuffle(idxs)
            n = len(idxs) // self.num_instances * self.num_instances
            per_pid[pid] = idxs[:n].reshape(-1, self.num_instances).tolist()
        avail = list(self.pids)
        order = []
        p = self.batch_size // self.num_instances
        while len(avail) >= p and len(order) < self.num_batches * self.batch_size:
            for j in rng.choice(len(avail), p, replace=False):
                order += per_pid[avail[j]].pop()
            avail = [pid for pid in avail if per_pid[pid]]
        for b in range(len(order) // self.batch_size):
            s = b * self.batch_size + self.rank * self.mini
            yield from order[s:s + self.mini]


class Backbone(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        gf = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        bn = self.bottleneck(gf)
        return (self.classifier(bn), gf) if self.training else bn


def triplet_hard(feat, y, margin=0.3):
    d = torch.cdist(feat, feat)
    pos = y.unsqueeze(0) == y.unsqueeze(1)
    ap = d.masked_fill(~pos, 0).max(1).values
    an = d.masked_fill(pos, 1e6).min(1).values
    return F.margin_ranking_loss(an, ap, torch.ones_like(an), margin=margin)


def compute_metrics(distmat, qp, gp, qc, gc, max_rank=10):
    idx = np.argsort(distmat, 1)
    cmc_all, aps = [], []
    for i in range(len(qp)):
        o = idx[i]
        keep = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        m = (gp[o][keep] == qp[i]).astype(np.float32)
        if m.sum() == 0:
            continue
        cmc_all.append(np.clip(m.cumsum(), 0, 1)[:max_rank])
        prec = m.cumsum() / np.arange(1, len(m) + 1)
        aps.append((prec * m).sum() / m.sum())
    return np.mean(cmc_all, 0), float(np.mean(aps))


@torch.no_grad()
def test(model, query, gallery, tf, device):
    model.eval()
    loader = DataLoader(ReIDSet(query + gallery, tf), batch_size=256, num_workers=8)
    feats = []
    for x, _, _ in loader:
        x = x.to(device)
        f = model(x) + model(torch.flip(x, dims=[3]))
        feats.append(F.normalize(f, dim=1))
    feats = torch.cat(feats)
    nq = len(query)
    distmat = (1 - feats[:nq] @ feats[nq:].t()).cpu().numpy()
    arr = lambda rs, j: np.asarray([r[j] for r in rs])
    return compute_metrics(distmat, arr(query, 1), arr(gallery, 1), arr(query, 2), arr(gallery, 2))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                            handlers=[logging.StreamHandler(), logging.FileHandler(osp.join(args.output_dir, "log.txt"))])
    torch.manual_seed(args.seed)

    train = load(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = load(osp.join(args.root, "query"))
    gallery = load(osp.join(args.root, "bounding_box_test"))
    num_classes = len({r[1] for r in train})

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), RandomOcclusion([r[0] for r in train], args.occ_prob),
                          T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), norm,
                          T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])

    train_sampler = DistributedRandomIdentitySampler(train, args.ims_per_batch, args.num_instance,
                                                     world_size, rank, args.seed)
    train_loader = DataLoader(ReIDSet(train, train_tf), batch_size=args.ims_per_batch // world_size,
                              sampler=train_sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = Backbone(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.base_lr,
                                 weight_decay=5e-4)
    iters_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: min(1.0, (it + 1) / (10 * iters_per_epoch))
        * 0.1 ** sum(it >= e * iters_per_epoch for e in (40, 70)))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_map = 0.0
    for epoch in range(1, args.max_epoch + 1):
        model.train()
        t0 = time.time()
        meters = torch.zeros(4, device=device)
        for img, pid, _ in train_loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                score, feat = model(img)
                loss_id = xent(score, pid)
            loss_tri = triplet_hard(feat.float(), pid)
            loss = loss_id + loss_tri
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            acc = (score.argmax(1) == pid).float().mean()
            meters += torch.stack([loss_id.detach().float(), loss_tri.detach(), acc, torch.ones_like(acc)])
        dist.all_reduce(meters)
        meters /= meters[3].clone()
        logger.info("Epoch %d: id %.3f tri %.3f acc %.3f lr %.2e (%.0fs)", epoch, meters[0], meters[1], meters[2],
                    scheduler.get_last_lr()[0], time.time() - t0)

        if epoch % args.eval_period == 0:
            if rank == 0:
                cmc, mAP = test(model.module, query, gallery, test_tf, device)
                logger.info("mAP %.1f%% R1 %.1f%% R5 %.1f%% R10 %.1f%%", 100 * mAP, 100 * cmc[0], 100 * cmc[4],
                            100 * cmc[9])
                torch.save(model.module.state_dict(), osp.join(args.output_dir, f"model_{epoch}.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(model.module.state_dict(), osp.join(args.output_dir, "model_best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
