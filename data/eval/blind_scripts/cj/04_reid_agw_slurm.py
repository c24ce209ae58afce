"""AGW-style re-ID baseline (GeM + BNNeck + weighted regularized triplet + center loss).

Submitted through Slurm, one task per GPU:

    #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10
    srun python 04_reid_agw_slurm.py --root /shared/datasets/MSMT17_V1 --output-dir /shared/exp/agw_msmt
"""
import argparse
import logging
import os
import os.path as osp
import subprocess
import sys
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from timm import create_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser("AGW")
    parser.add_argument("--root", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--batch-size", type=int, default=16, help="images per GPU (P*K)")
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3.5e-4, help="for a global batch of 64")
    parser.add_argument("--center-lr", type=float, default=0.5)
    parser.add_argument("--center-weight", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def init_distributed():
    if "RANK" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        local_rank = int(os.environ["SLURM_LOCALID"])
        if "MASTER_ADDR" not in os.environ:
            hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
            os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def read_msmt_list(root, list_name, img_dir):
    items = []
    with open(osp.join(root, list_name)) as f:
        for line in f:
            rel, pid = line.split()
            camid = int(rel.split("_")[2]) - 1
            items.append((osp.join(root, img_dir, rel), int(pid), camid))
    return items


class ReIDSet(Dataset):
    def __init__(self, items, transform):
        self.items, self.transform = items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), pid, cam, i


class DistributedIdentitySampler(Sampler):
    """P x K sampler; every rank builds the same global batch list from (seed, epoch) and takes its share."""

    def __init__(self, items, batch_size, num_instances, num_replicas, rank, seed=0):
        self.K, self.P = num_instances, batch_size // num_instances
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.index_dic = defaultdict(list)
        for idx, (_, pid, _) in enumerate(items):
            self.index_dic[pid].append(idx)
        self.pids = sorted(self.index_dic)
        n_chunks = sum(max(len(v), self.K) // self.K for v in self.index_dic.values())
        self.num_batches = n_chunks // (self.P * num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            idxs = np.array(self.index_dic[pid])
            if len(idxs) < self.K:
                idxs = rng.choice(idxs, self.K, replace=True)
            idxs = rng.permutation(idxs)
            chunks[pid] = [idxs[i:i + self.K].tolist() for i in range(0, len(idxs) - self.K + 1, self.K)]
        avail, batches = list(self.pids), []
        while len(avail) >= self.P:
            batch = []
            for pid in rng.choice(avail, self.P, replace=False).tolist():
                batch.extend(chunks[pid].pop())
                if not chunks[pid]:
                    avail.remove(pid)
            batches.append(batch)
        n = min(self.num_batches, len(batches) // self.num_replicas)
        for b in batches[self.rank:n * self.num_replicas:self.num_replicas]:
            yield from b

    def __len__(self):
        return self.num_batches * self.P * self.K


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p, self.eps = nn.Parameter(torch.ones(1) * p), eps

    def forward(self, x):
        return F.adaptive_avg_pool2d(x.clamp(min=self.eps).pow(self.p), 1).pow(1.0 / self.p).flatten(1)


class AGW(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = create_model("resnet50", pretrained=True, num_classes=0, global_pool="")
        self.pool = GeM()
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        feat = self.pool(self.backbone(x))
        bn_feat = self.neck(feat)
        return (self.classifier(bn_feat), feat) if self.training else bn_feat


class CenterLoss(nn.Module):
    def __init__(self, num_classes, feat_dim):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        return 0.5 * (x - self.centers[labels]).pow(2).sum(1).mean()


def weighted_regularized_triplet(feats, labels):
    dist_mat = torch.cdist(feats, feats)
    is_pos = labels[:, None].eq(labels[None]).float()
    is_neg = 1.0 - is_pos
    dist_ap, dist_an = dist_mat * is_pos, dist_mat * is_neg

    def softmax_weights(d, mask):
        diff = d - (d * mask).max(dim=1, keepdim=True)[0]
        e = torch.exp(diff) * mask
        return e / (e.sum(dim=1, keepdim=True) + 1e-6)

    furthest_pos = (dist_ap * softmax_weights(dist_ap, is_pos)).sum(1)
    closest_neg = (dist_an * softmax_weights(-dist_an, is_neg)).sum(1)
    return F.soft_margin_loss(closest_neg - furthest_pos, torch.ones_like(closest_neg))


@torch.no_grad()
def extract_features(model, loader, num_items, device):
    model.eval()
    feats, idxs = [], []
    for imgs, _, _, idx in loader:
        imgs = imgs.to(device, non_blocking=True)
        f = model(imgs) + model(imgs.flip(3))
        feats.append(F.normalize(f, dim=1))
        idxs.append(idx.to(device))
    feats, idxs = torch.cat(feats), torch.cat(idxs)
    all_feats = [torch.empty_like(feats) for _ in range(dist.get_world_size())]
    all_idxs = [torch.empty_like(idxs) for _ in range(dist.get_world_size())]
    dist.all_gather(all_feats, feats)
    dist.all_gather(all_idxs, idxs)
    out = torch.empty(num_items, feats.size(1), device=device)
    out[torch.cat(all_idxs)] = torch.cat(all_feats)
    return out.cpu()


def rank_and_map(qf, gf, q_pids, g_pids, q_cams, g_cams):
    order = torch.cdist(qf, gf).argsort(dim=1).numpy()
    cmc, aps = np.zeros(gf.size(0)), []
    for i in range(qf.size(0)):
        o = order[i]
        keep = ~((g_pids[o] == q_pids[i]) & (g_cams[o] == q_cams[i]))
        hits = (g_pids[o][keep] == q_pids[i]).astype(np.float32)
        if hits.sum() == 0:
            continue
        cmc[np.argmax(hits):] += 1
        aps.append(((hits.cumsum() / np.arange(1, len(hits) + 1)) * hits).sum() / hits.sum())
    return cmc / len(aps), float(np.mean(aps))


def main():
    args = get_parser().parse_args()
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    log = logging.getLogger("agw")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    train_items = read_msmt_list(args.root, "list_train.txt", "train")
    query_items = read_msmt_list(args.root, "list_query.txt", "test")
    gallery_items = read_msmt_list(args.root, "list_gallery.txt", "test")
    num_classes = len({pid for _, pid, _ in train_items})

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((384, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])

    sampler = DistributedIdentitySampler(train_items, args.batch_size, args.num_instances, world_size, rank, args.seed)
    train_loader = DataLoader(ReIDSet(train_items, train_tf), batch_size=args.batch_size, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    test_set = ReIDSet(query_items + gallery_items, test_tf)
    test_loader = DataLoader(test_set, batch_size=128, num_workers=8, pin_memory=True,
                             sampler=DistributedSampler(test_set, shuffle=False))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AGW(num_classes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    center_criterion = CenterLoss(num_classes, 2048).to(device)
    dist.broadcast(center_criterion.centers.data, src=0)

    lr = args.lr * args.batch_size * world_size / 64
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=5e-4)
    center_optimizer = torch.optim.SGD(center_criterion.parameters(), lr=args.center_lr)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=10)
    decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, [40, 70], 0.1)
    scheduler = torch.optim.lr_scheduler.ChainedScheduler([warmup, decay])

    start_epoch = 0
    ckpt_path = osp.join(args.output_dir, "checkpoint.pth")
    if osp.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        center_criterion.load_state_dict(ckpt["center"])
        optimizer.load_state_dict(ckpt["optimizer"])
        center_optimizer.load_state_dict(ckpt["center_optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
        log.info("resumed from epoch %d", start_epoch)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    log.info("world %d, %d ids, %d images, lr %.2e", world_size, num_classes, len(train_items), lr)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for imgs, pids, _, _ in train_loader:
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            logits, feats = model(imgs)
            loss = (F.cross_entropy(logits, pids, label_smoothing=0.1) + weighted_regularized_triplet(feats, pids)
                    + args.center_weight * center_criterion(feats, pids))
            optimizer.zero_grad(set_to_none=True)
            center_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # centers live outside DDP: average their gradient by hand so every rank keeps the same centers
            grad = center_criterion.centers.grad
            dist.all_reduce(grad)
            grad.mul_(1.0 / (world_size * args.center_weight))
            center_optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)
        log.info("epoch %d/%d  loss %.4f  lr %.2e", epoch + 1, args.epochs, (running[0] / running[1]).item(),
                 optimizer.param_groups[0]["lr"])

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            feats = extract_features(model.module, test_loader, len(test_set), device)
            if rank == 0:
                nq = len(query_items)
                pids = np.array([p for _, p, _ in test_set.items])
                cams = np.array([c for _, _, c in test_set.items])
                cmc, mAP = rank_and_map(feats[:nq], feats[nq:], pids[:nq], pids[nq:], cams[:nq], cams[nq:])
                log.info("epoch %d: mAP %.2f rank-1 %.2f rank-10 %.2f", epoch + 1, 100 * mAP, 100 * cmc[0], 100 * cmc[9])
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "center": center_criterion.state_dict(),
                        "optimizer": optimizer.state_dict(), "center_optimizer": center_optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
