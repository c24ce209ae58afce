"""
Strong-baseline style person re-ID on Market-1501 (ResNet50, last stride 1, BNNeck, CE+LS + triplet).
Multi-GPU with DDP:

    torchrun --nproc_per_node=2 13_reid_market_triplet.py --root /data/market1501 --ims-per-batch 64

Evaluation (rank-1 / mAP) runs on rank 0 over the whole query/gallery set.
"""
import argparse
import glob
import math
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
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

DEVICE = torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')


def parse():
    p = argparse.ArgumentParser()
    p.add_argument('--root', default='/data/market1501')
    p.add_argument('--ims-per-batch', type=int, default=64, help='per GPU, P*K')
    p.add_argument('--num-instance', type=int, default=4)
    p.add_argument('--epochs', type=int, default=120)
    p.add_argument('--lr', type=float, default=3.5e-4)
    p.add_argument('--margin', type=float, default=0.3)
    p.add_argument('--eval-period', type=int, default=10)
    p.add_argument('--out', default='logs/market_r50')
    return p.parse_args()


def parse_market(folder, relabel):
    pat = re.compile(r'([-\d]+)_c(\d)')
    items, pids = [], set()
    for f in sorted(glob.glob(osp.join(folder, '*.jpg'))):
        pid, cam = map(int, pat.search(f).groups())
        if pid == -1:
            continue
        items.append((f, pid, cam - 1))
        pids.add(pid)
    if relabel:
        m = {p: i for i, p in enumerate(sorted(pids))}
        items = [(f, m[p], c) for f, p, c in items]
    return items


class ReIDSet(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, pid, cam = self.items[i]
        return self.tf(Image.open(f).convert('RGB')), pid, cam


class DistributedIdentitySampler(Sampler):
    """P identities x K instances per batch. The global list of batches is built with the
    same seed on every rank, then split so that all ranks see the same number of batches."""

    def __init__(self, items, batch_per_gpu, k, rank, world, seed=0):
        self.index_dic = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.index_dic[pid].append(i)
        self.pids = list(self.index_dic)
        self.bs, self.k, self.rank, self.world, self.seed = batch_per_gpu, k, rank, world, seed
        self.epoch = 0
        self._len = None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        chunks = []
        for pid in self.pids:
            idxs = list(self.index_dic[pid])
            if len(idxs) < self.k:
                idxs = idxs + rng.choices(idxs, k=self.k - len(idxs))
            rng.shuffle(idxs)
            chunks += [idxs[i:i + self.k] for i in range(0, len(idxs) - self.k + 1, self.k)]
        rng.shuffle(chunks)
        per = self.bs // self.k
        batches = [sum(chunks[i:i + per], []) for i in range(0, len(chunks) - per + 1, per)]
        n = len(batches) // self.world * self.world
        return batches[:n][self.rank::self.world]

    def __iter__(self):
        for b in self._batches():
            yield from b

    def __len__(self):
        if self._len is None:
            self._len = sum(len(b) for b in self._batches())
        return self._len


class Backbone(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = torchvision.models.resnet50(weights='IMAGENET1K_V2')
        base.layer4[0].conv2.stride = (1, 1)
        base.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(base.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)

    def forward(self, x):
        feat = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        bn = self.bnneck(feat)
        if self.training:
            return self.classifier(bn), feat
        return bn


def triplet_hard(feat, pids, margin):
    d = torch.cdist(feat, feat)
    same = pids[:, None] == pids[None, :]
    ap = (d * same).max(1)[0]
    an = (d + 1e5 * same).min(1)[0]
    return F.relu(ap - an + margin).mean()


def ce_ls(logits, pids, eps=0.1):
    logp = F.log_softmax(logits, 1)
    tgt = torch.full_like(logp, eps / logits.size(1)).scatter_(1, pids[:, None], 1 - eps + eps / logits.size(1))
    return -(tgt * logp).sum(1).mean()


@torch.no_grad()
def extract(model, loader):
    feats, pids, cams = [], [], []
    for img, pid, cam in loader:
        f = model(img.to(DEVICE)) + model(img.flip(-1).to(DEVICE))
        feats.append(F.normalize(f, dim=1).cpu())
        pids.append(pid)
        cams.append(cam)
    return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()


def eval_market(qf, qp, qc, gf, gp, gc):
    dist_mat = (1 - qf @ gf.t()).numpy()
    aps, cmc = [], np.zeros(50)
    for i in range(len(qp)):
        order = np.argsort(dist_mat[i])
        keep = ~((gp[order] == qp[i]) & (gc[order] == qc[i]))
        match = (gp[order] == qp[i])[keep]
        if not match.any():
            continue
        hits = np.where(match)[0]
        cmc[hits[0]:] += 1
        aps.append(np.mean([(k + 1) / (h + 1) for k, h in enumerate(hits)]))
    return cmc[0] / len(aps), float(np.mean(aps))


def main():
    args = parse()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()

    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                          T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406])])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    train_items = parse_market(osp.join(args.root, 'bounding_box_train'), relabel=True)
    num_classes = len({p for _, p, _ in train_items})
    sampler = DistributedIdentitySampler(train_items, args.ims_per_batch, args.num_instance, rank, world)
    train_loader = DataLoader(ReIDSet(train_items, train_tf), batch_size=args.ims_per_batch, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    q_loader = DataLoader(ReIDSet(parse_market(osp.join(args.root, 'query'), False), test_tf), batch_size=256,
                          num_workers=8)
    g_loader = DataLoader(ReIDSet(parse_market(osp.join(args.root, 'bounding_box_test'), False), test_tf),
                          batch_size=256, num_workers=8)

    model = Backbone(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(DEVICE)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    params = [{'params': [p], 'lr': args.lr * (2 if 'bias' in n else 1), 'weight_decay': 0 if 'bias' in n else 5e-4}
              for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    warm = 10

    def lr_lambda(ep):
        if ep < warm:
            return 0.1 + 0.9 * ep / warm
        return 0.5 * (1 + math.cos(math.pi * (ep - warm) / (args.epochs - warm)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    writer = SummaryWriter(args.out) if rank == 0 else None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stat = torch.zeros(3, device=DEVICE)
        for img, pid, _ in train_loader:
            img, pid = img.to(DEVICE, non_blocking=True), pid.to(DEVICE, non_blocking=True)
            logits, feat = model(img)
            l_id = ce_ls(logits, pid)
            l_tri = triplet_hard(feat, pid, args.margin)
            loss = l_id + l_tri
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stat += torch.stack([l_id.detach(), l_tri.detach(), (logits.argmax(1) == pid).float().mean()])
        scheduler.step()
        dist.all_reduce(stat)
        stat /= world * len(train_loader)
        if rank == 0:
            print(f'ep {epoch + 1} id {stat[0]:.3f} tri {stat[1]:.3f} acc {stat[2]:.3f} {time.time() - t0:.0f}s')
            writer.add_scalar('loss/id', stat[0].item(), epoch)
            writer.add_scalar('loss/tri', stat[1].item(), epoch)

        if (epoch + 1) % args.eval_period == 0:
            if rank == 0:
                net = model.module.eval()
                qf, qp, qc = extract(net, q_loader)
                gf, gp, gc = extract(net, g_loader)
                r1, mAP = eval_market(qf, qp, qc, gf, gp, gc)
                print(f'  rank-1 {r1:.2%}  mAP {mAP:.2%}')
                writer.add_scalar('eval/rank1', r1, epoch)
                writer.add_scalar('eval/mAP', mAP, epoch)
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), osp.join(args.out, f'model_{epoch + 1}.pth'))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
