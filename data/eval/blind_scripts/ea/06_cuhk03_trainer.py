"""
CUHK03-NP (detected) re-ID trainer: ResNet50 + BNNeck, ID + triplet loss.

    torchrun --nproc_per_node=4 06_cuhk03_trainer.py \
        --data-dir /nfs/datasets/cuhk03-np/detected --work-dir /nfs/exp/cuhk03_r50
"""
import argparse
import logging
import os
import random
import re
import shutil
import time
from collections import defaultdict
from glob import glob

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

log = logging.getLogger("cuhk03")


def build_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--ims-per-batch", type=int, default=64)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--max-epoch", type=int, default=120)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--eval-period", type=int, default=10)
    p.add_argument("--ckpt-period", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from work-dir/last.pth")
    p.add_argument("--num-workers", type=int, default=8)
    return p.parse_args()


def load_split(folder, relabel):
    rx = re.compile(r"([-\d]+)_c(\d)")
    items = []
    for path in sorted(glob(os.path.join(folder, "*.png"))):
        pid, cam = map(int, rx.search(os.path.basename(path)).groups())
        items.append((path, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({pid for _, pid, _ in items}))}
        items = [(p, lut[pid], c) for p, pid, c in items]
    return items


class ReidSet(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        p, pid, cam = self.items[idx]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedRandomIdentitySampler(Sampler):
    def __init__(self, items, ims_per_batch, num_instances, world_size, rank, seed=20):
        self.ims_per_batch, self.num_instances = ims_per_batch, num_instances
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.pids_per_batch = ims_per_batch // num_instances
        self.local = ims_per_batch // world_size
        self.epoch = 0
        self.pid_index = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.pid_index[pid].append(i)
        self.pids = sorted(self.pid_index)
        self.num_iters = sum(max(len(v), num_instances) // num_instances for v in self.pid_index.values()) \
            // self.pids_per_batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_iters * self.local

    def __iter__(self):
        rs = np.random.RandomState(self.seed + self.epoch)
        buckets = {}
        for pid in self.pids:
            idx = np.array(self.pid_index[pid])
            if len(idx) < self.num_instances:
                idx = rs.choice(idx, self.num_instances, replace=True)
            idx = rs.permutation(idx)
            n = len(idx) // self.num_instances * self.num_instances
            buckets[pid] = list(idx[:n].reshape(-1, self.num_instances))
        active = list(self.pids)
        for _ in range(self.num_iters):
            if len(active) < self.pids_per_batch:
                break
            chosen = rs.choice(len(active), self.pids_per_batch, replace=False)
            batch = []
            for pid in [active[c] for c in chosen]:
                batch.extend(buckets[pid].pop().tolist())
            active = [pid for pid in active if buckets[pid]]
            yield from batch[self.rank * self.local:(self.rank + 1) * self.local]


class Net(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        m = torchvision.models.resnet50(weights="DEFAULT")
        m.layer4[0].conv2.stride = (1, 1)
        m.layer4[0].downsample[0].stride = (1, 1)
        self.features = nn.Sequential(*list(m.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, n_cls, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        gf = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        bf = self.bnneck(gf)
        return (self.classifier(bf), gf) if self.training else bf


def triplet_loss(f, y, margin=0.3):
    d = torch.cdist(f, f)
    pos = y[:, None].eq(y[None, :])
    return F.relu(d.masked_fill(~pos, 0).amax(1) - d.masked_fill(pos, 1e6).amin(1) + margin).mean()


def rank_metrics(dist_qg, qp, gp, qc, gc, ranks=(1, 5, 10)):
    ind = np.argsort(dist_qg, axis=1)
    aps, cmc = [], np.zeros(max(ranks))
    valid_q = 0
    for i in range(dist_qg.shape[0]):
        o = ind[i]
        keep = (gp[o] != qp[i]) | (gc[o] != qc[i])
        hit = (gp[o][keep] == qp[i])
        if not hit.any():
            continue
        valid_q += 1
        first = np.argmax(hit)
        if first < len(cmc):
            cmc[first:] += 1
        pos = np.where(hit)[0]
        aps.append(np.mean((np.arange(len(pos)) + 1) / (pos + 1)))
    cmc /= valid_q
    return float(np.mean(aps)), {r: cmc[r - 1] for r in ranks}


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        if self.rank == 0:
            os.makedirs(args.work_dir, exist_ok=True)
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                                handlers=[logging.StreamHandler(),
                                          logging.FileHandler(os.path.join(args.work_dir, "train.log"))])
        dist.barrier()

        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.train_items = load_split(os.path.join(args.data_dir, "bounding_box_train"), relabel=True)
        self.query = load_split(os.path.join(args.data_dir, "query"), relabel=False)
        self.gallery = load_split(os.path.join(args.data_dir, "bounding_box_test"), relabel=False)
        tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                        T.ToTensor(), norm, T.RandomErasing(p=0.5)])
        self.test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
        self.sampler = DistributedRandomIdentitySampler(self.train_items, args.ims_per_batch, args.instances,
                                                        self.world, self.rank)
        self.loader = DataLoader(ReidSet(self.train_items, tf), batch_size=args.ims_per_batch // self.world,
                                 sampler=self.sampler, num_workers=args.num_workers, pin_memory=True,
                                 drop_last=True)

        n_cls = len({pid for _, pid, _ in self.train_items})
        self.net = nn.SyncBatchNorm.convert_sync_batchnorm(Net(n_cls)).to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.optim = torch.optim.Adam([p for p in self.net.parameters() if p.requires_grad],
                                      lr=args.lr, weight_decay=5e-4)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.optim, milestones=[40, 70], gamma=0.1)
        self.ce = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.start_epoch, self.best_map = 0, 0.0
        if args.resume and os.path.exists(os.path.join(args.work_dir, "last.pth")):
            self.load_checkpoint(os.path.join(args.work_dir, "last.pth"))

    def load_checkpoint(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.net.load_state_dict(ckpt["model"])
        self.optim.load_state_dict(ckpt["optim"])
        self.sched.load_state_dict(ckpt["sched"])
        self.start_epoch, self.best_map = ckpt["epoch"], ckpt["best_map"]
        log.info("resumed at epoch %d (best mAP %.3f)", self.start_epoch, self.best_map)

    def save_checkpoint(self, epoch, is_best):
        state = {"model": self.net.state_dict(), "optim": self.optim.state_dict(),
                 "sched": self.sched.state_dict(), "epoch": epoch, "best_map": self.best_map}
        path = os.path.join(self.args.work_dir, "last.pth")
        torch.save(state, path)
        if is_best:
            shutil.copyfile(path, os.path.join(self.args.work_dir, "model_best.pth"))

    @torch.no_grad()
    def evaluate(self):
        self.net.eval()
        loader = DataLoader(ReidSet(self.query + self.gallery, self.test_tf), batch_size=256,
                            num_workers=self.args.num_workers)
        feats = torch.cat([self.net(x.to(self.device, non_blocking=True)) for x, _, _ in loader])
        feats = F.normalize(feats, dim=1)
        nq = len(self.query)
        d = torch.cdist(feats[:nq], feats[nq:]).cpu().numpy()
        qp, qc = np.array([x[1] for x in self.query]), np.array([x[2] for x in self.query])
        gp, gc = np.array([x[1] for x in self.gallery]), np.array([x[2] for x in self.gallery])
        return rank_metrics(d, qp, gp, qc, gc)

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        agg = torch.zeros(3, device=self.device)
        for x, y, _ in self.loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits, feat = self.model(x)
            l_id, l_tri = self.ce(logits, y), triplet_loss(feat, y)
            self.optim.zero_grad(set_to_none=True)
            (l_id + l_tri).backward()
            self.optim.step()
            agg += torch.stack([l_id.detach(), l_tri.detach(), torch.tensor(1.0, device=self.device)])
        self.sched.step()
        dist.all_reduce(agg)
        return (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item()

    def run(self):
        for epoch in range(self.start_epoch, self.args.max_epoch):
            t = time.time()
            l_id, l_tri = self.train_epoch(epoch)
            log.info("epoch %d  id %.3f  tri %.3f  lr %.1e  (%.0fs)", epoch + 1, l_id, l_tri,
                     self.sched.get_last_lr()[0], time.time() - t)
            is_best = False
            if (epoch + 1) % self.args.eval_period == 0:
                if self.rank == 0:
                    mAP, cmc = self.evaluate()
                    log.info("  mAP %.1f  R1 %.1f  R5 %.1f  R10 %.1f", 100 * mAP, 100 * cmc[1], 100 * cmc[5],
                             100 * cmc[10])
                    is_best = mAP > self.best_map
                    self.best_map = max(mAP, self.best_map)
                flag = torch.tensor([float(is_best), self.best_map], device=self.device)
                dist.broadcast(flag, src=0)
                is_best, self.best_map = bool(flag[0].item()), flag[1].item()
            if (epoch + 1) % self.args.ckpt_period == 0 or is_best:
                self.save_checkpoint(epoch + 1, is_best)
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(build_args()).run()
