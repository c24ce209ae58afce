# Person re-identification baseline (BNNeck + triplet + ID loss) on Market-1501
# launch: torchrun --nproc_per_node=4 02_reid_triplet.py --root /data/market1501
import os
import re
import glob
import copy
import random
import argparse
import logging
from collections import defaultdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, Sampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
from torchvision.models import resnet50
from PIL import Image

logger = logging.getLogger('reid')


def get_args():
    p = argparse.ArgumentParser('reid')
    p.add_argument('--root', default='/data/market1501')
    p.add_argument('--epochs', type=int, default=120)
    p.add_argument('--ims_per_batch', type=int, default=64)
    p.add_argument('--num_instance', type=int, default=4)
    p.add_argument('--base_lr', type=float, default=3.5e-4)
    p.add_argument('--margin', type=float, default=0.3)
    p.add_argument('--eval_period', type=int, default=10)
    p.add_argument('--output_dir', default='./logs/market_bot')
    p.add_argument('--workers', type=int, default=8)
    return p.parse_args()


class Market1501(Dataset):
    pattern = re.compile(r'([-\d]+)_c(\d)')

    def __init__(self, root, sub, transform, relabel=False):
        self.transform = transform
        self.data = []
        pids = set()
        for f in sorted(glob.glob(os.path.join(root, sub, '*.jpg'))):
            pid, cam = map(int, self.pattern.search(f).groups())
            if pid == -1:
                continue
            pids.add(pid)
            self.data.append((f, pid, cam - 1))
        if relabel:
            m = {p: i for i, p in enumerate(sorted(pids))}
            self.data = [(f, m[p], c) for f, p, c in self.data]
        self.num_pids = len(pids)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        f, pid, cam = self.data[i]
        return self.transform(Image.open(f).convert('RGB')), pid, cam


class RandomIdentitySampler(Sampler):
    """P identities x K instances per batch."""

    def __init__(self, data_source, batch_size, num_instances):
        self.batch_size = batch_size
        self.num_instances = num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(data_source):
            self.index_dic[pid].append(index)
        self.pids = list(self.index_dic.keys())
        self.length = 0
        for pid in self.pids:
            n = max(len(self.index_dic[pid]), num_instances)
            self.length += n - n % num_instances

    def __iter__(self):
        batch_idxs_dict = defaultdict(list)
        for pid in self.pids:
            idxs = copy.deepcopy(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = np.random.choice(idxs, size=self.num_instances, replace=True).tolist()
            random.shuffle(idxs)
            batch = []
            for idx in idxs:
                batch.append(idx)
                if len(batch) == self.num_instances:
                    batch_idxs_dict[pid].append(batch)
                    batch = []
        avai_pids = copy.deepcopy(self.pids)
        final = []
        while len(avai_pids) >= self.num_pids_per_batch:
            selected = random.sample(avai_pids, self.num_pids_per_batch)
            for pid in selected:
                final.extend(batch_idxs_dict[pid].pop(0))
                if len(batch_idxs_dict[pid]) == 0:
                    avai_pids.remove(pid)
        return iter(final)

    def __len__(self):
        return self.length


class Baseline(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = resnet50(weights='IMAGENET1K_V1')
        base.layer4[0].conv2.stride = (1, 1)
        base.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(base.children())[:-2])
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)

    def forward(self, x):
        feat = self.gap(self.base(x)).flatten(1)
        bn = self.bottleneck(feat)
        if self.training:
            return self.classifier(bn), feat
        return bn


def triplet_hard(feat, pids, margin):
    d = torch.cdist(feat, feat)
    same = pids.unsqueeze(0) == pids.unsqueeze(1)
    ap = (d * same.float()).max(1)[0]
    an = (d + 1e5 * same.float()).min(1)[0]
    return F.margin_ranking_loss(an, ap, torch.ones_like(ap), margin=margin)


@torch.no_grad()
def evaluate(model, q_loader, g_loader):
    model.eval()

    def extract(loader):
        feats, pids, cams = [], [], []
        for img, pid, cam in loader:
            feats.append(F.normalize(model(img.cuda()), dim=1).cpu())
            pids.append(pid)
            cams.append(cam)
        return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()

    qf, qp, qc = extract(q_loader)
    gf, gp, gc = extract(g_loader)
    dist_mat = (1 - qf @ gf.t()).numpy()
    aps, r1 = [], 0
    for i in range(len(qp)):
        order = np.argsort(dist_mat[i])
        keep = ~((gp[order] == qp[i]) & (gc[order] == qc[i]))
        match = (gp[order] == qp[i])[keep]
        if not match.any():
            continue
        r1 += match[0]
        cum = match.cumsum()
        prec = cum / (np.arange(len(match)) + 1)
        aps.append((prec * match).sum() / match.sum())
    return float(np.mean(aps)), r1 / len(qp)


def main():
    args = get_args()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    else:
        logging.basicConfig(level=logging.WARNING)

    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                          T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = Market1501(args.root, 'bounding_box_train', train_tf, relabel=True)
    per_gpu = args.ims_per_batch // dist.get_world_size()
    sampler = RandomIdentitySampler(train_set.data, per_gpu, args.num_instance)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)

    model = Baseline(train_set.num_pids).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.base_lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [40, 70], gamma=0.1)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    for epoch in range(1, args.epochs + 1):
        model.train()
        tot, n = torch.zeros(2, device='cuda'), 0
        for img, pid, _ in train_loader:
            img, pid = img.cuda(non_blocking=True), pid.cuda(non_blocking=True)
            score, feat = model(img)
            loss_id = ce(score, pid)
            loss_tri = triplet_hard(feat, pid, args.margin)
            loss = loss_id + loss_tri
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss_id.detach(), loss_tri.detach()])
            n += 1
        scheduler.step()
        dist.all_reduce(tot)
        tot /= (n * dist.get_world_size())
        logger.info('epoch %d id %.3f tri %.3f lr %.2e', epoch, tot[0], tot[1], scheduler.get_last_lr()[0])

        if epoch % args.eval_period == 0 and rank == 0:
            q = Market1501(args.root, 'query', test_tf)
            g = Market1501(args.root, 'bounding_box_test', test_tf)
            ql = DataLoader(q, batch_size=256, num_workers=4)
            gl = DataLoader(g, batch_size=256, num_workers=4)
            mAP, r1 = evaluate(model.module, ql, gl)
            logger.info('epoch %d mAP %.1f rank-1 %.1f', epoch, 100 * mAP, 100 * r1)
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, 'model_%d.pth' % epoch))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
