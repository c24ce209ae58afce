"""
DukeMTMC-reID: ResNet50 with IBN-a style instance norm in layer1-3, BNNeck,
soft-margin triplet + label-smoothed ID loss.

    torchrun --nproc_per_node=4 10_duke_ibn_triplet.py --data-root /data/DukeMTMC-reID --batch-size 64
"""
import argparse
import copy
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
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--batch-size", type=int, default=64, help="total batch size")
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--max-epoch", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3.5e-4)
    parser.add_argument("--eval-step", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--logs-dir", default="logs/duke_ibn")
    parser.add_argument("--workers", type=int, default=4)
    return parser.parse_args()


def process_dir(dir_path, relabel=False):
    img_paths = sorted(glob(osp.join(dir_path, "*.jpg")))
    pattern = re.compile(r"([-\d]+)_c(\d)")
    pid_container = sorted({int(pattern.search(p).group(1)) for p in img_paths})
    pid2label = {pid: label for label, pid in enumerate(pid_container)}
    dataset = []
    for img_path in img_paths:
        pid, camid = map(int, pattern.search(img_path).groups())
        if relabel:
            pid = pid2label[pid]
        dataset.append((img_path, pid, camid - 1))
    return dataset


class Preprocessor(Dataset):
    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        fname, pid, camid = self.dataset[index]
        return self.transform(Image.open(fname).convert("RGB")), pid, camid


class RandomIdentitySampler(Sampler):
    """Randomly samples N identities, then K instances of each: batch = N * K."""

    def __init__(self, data_source, batch_size, num_instances):
        self.data_source = data_source
        self.batch_size = batch_size
        self.num_instances = num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.index_dic = defaultdict(list)
        for index, (_, pid, _) in enumerate(data_source):
            self.index_dic[pid].append(index)
        self.pids = list(self.index_dic.keys())
        self.length = 0
        for pid in self.pids:
            num = max(len(self.index_dic[pid]), num_instances)
            self.length += num - num % num_instances

    def __iter__(self):
        batch_idxs_dict = defaultdict(list)
        for pid in self.pids:
            idxs = copy.deepcopy(self.index_dic[pid])
            if len(idxs) < self.num_instances:
                idxs = np.random.choice(idxs, size=self.num_instances, replace=True).tolist()
            random.shuffle(idxs)
            batch_idxs = []
            for idx in idxs:
                batch_idxs.append(idx)
                if len(batch_idxs) == self.num_instances:
                    batch_idxs_dict[pid].append(batch_idxs)
                    batch_idxs = []
        avai_pids = copy.deepcopy(self.pids)
        final_idxs = []
        while len(avai_pids) >= self.num_pids_per_batch:
            selected_pids = random.sample(avai_pids, self.num_pids_per_batch)
            for pid in selected_pids:
                final_idxs.extend(batch_idxs_dict[pid].pop(0))
                if len(batch_idxs_dict[pid]) == 0:
                    avai_pids.remove(pid)
        return iter(final_idxs)

    def __len__(self):
        return self.length


class IBN(nn.Module):
    """Half instance norm, half batch norm (IBN-a)."""

    def __init__(self, planes):
        super().__init__()
        self.half = planes // 2
        self.IN = nn.InstanceNorm2d(self.half, affine=True)
        self.BN = nn.BatchNorm2d(planes - self.half)

    def forward(self, x):
        a, b = torch.split(x, [self.half, x.size(1) - self.half], 1)
        return torch.cat([self.IN(a.contiguous()), self.BN(b.contiguous())], 1)


def resnet50_ibn_a():
    net = torchvision.models.resnet50(weights="IMAGENET1K_V1")
    for layer in [net.layer1, net.layer2, net.layer3]:
        for block in layer:
            bn = block.bn1
            ibn = IBN(bn.num_features)
            ibn.BN.load_state_dict({k: v[ibn.half:] if v.dim() else v for k, v in bn.state_dict().items()})
            block.bn1 = ibn
    net.layer4[0].conv2.stride = (1, 1)
    net.layer4[0].downsample[0].stride = (1, 1)
    return net


class ReIDModel(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet50_ibn_a()
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        feat = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        bn_feat = self.bottleneck(feat)
        if self.training:
            return self.classifier(bn_feat), feat
        return bn_feat


def soft_triplet(feat, target):
    d = torch.cdist(feat, feat)
    pos = target[:, None] == target[None]
    ap = d.masked_fill(~pos, 0).amax(1)
    an = d.masked_fill(pos, 1e6).amin(1)
    return F.softplus(ap - an).mean()


@torch.no_grad()
def evaluate(model, query, gallery, transform, device):
    model.eval()
    loader = DataLoader(Preprocessor(query + gallery, transform), batch_size=256, num_workers=8)
    feats = torch.cat([model(img.to(device)) for img, _, _ in loader])
    feats = F.normalize(feats)
    qf, gf = feats[:len(query)], feats[len(query):]
    distmat = torch.cdist(qf, gf).cpu().numpy()
    q_pids, q_cams = np.array([q[1] for q in query]), np.array([q[2] for q in query])
    g_pids, g_cams = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    aps, cmc = [], np.zeros(10)
    valid = 0
    for i in range(len(query)):
        order = np.argsort(distmat[i])
        keep = ~((g_pids[order] == q_pids[i]) & (g_cams[order] == q_cams[i]))
        good = g_pids[order][keep] == q_pids[i]
        if not good.any():
            continue
        valid += 1
        hits = np.flatnonzero(good)
        aps.append(np.mean(np.arange(1, len(hits) + 1) / (hits + 1)))
        if hits[0] < 10:
            cmc[hits[0]:] += 1
    return float(np.mean(aps)), cmc / valid


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    world_size = dist.get_world_size()
    is_main = dist.get_rank() == 0
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    train = process_dir(osp.join(args.data_root, "bounding_box_train"), relabel=True)
    query = process_dir(osp.join(args.data_root, "query"))
    gallery = process_dir(osp.join(args.data_root, "bounding_box_test"))
    num_classes = len({pid for _, pid, _ in train})

    normalizer = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_transformer = T.Compose([T.Resize((256, 128), interpolation=3), T.RandomHorizontalFlip(p=0.5),
                                   T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), normalizer,
                                   T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406])])
    test_transformer = T.Compose([T.Resize((256, 128), interpolation=3), T.ToTensor(), normalizer])

    per_gpu = args.batch_size // world_size
    train_loader = DataLoader(Preprocessor(train, train_transformer), batch_size=per_gpu,
                              sampler=RandomIdentitySampler(train, per_gpu, args.num_instances),
                              num_workers=args.workers, pin_memory=True, drop_last=True)

    model = ReIDModel(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [{"params": [p], "lr": args.lr, "weight_decay": 0.0 if "bias" in n else 5e-4}
              for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: (e + 1) / 10 if e < 10 else 0.1 ** sum(e >= m for m in (40, 70)))
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)

    if is_main:
        os.makedirs(args.logs_dir, exist_ok=True)
        print(f"Duke: {num_classes} ids, {len(train)} train imgs, {len(query)} query, {len(gallery)} gallery")

    best_mAP = 0.0
    for epoch in range(args.max_epoch):
        model.train()
        start = time.time()
        sums = torch.zeros(3, device=device)
        for i, (imgs, pids, _) in enumerate(train_loader):
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            logits, feats = model(imgs)
            loss_ce, loss_tr = xent(logits, pids), soft_triplet(feats, pids)
            loss = loss_ce + loss_tr
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sums += torch.stack([loss_ce.detach(), loss_tr.detach(), torch.ones_like(loss_ce)])
        lr_scheduler.step()
        dist.all_reduce(sums)
        if is_main:
            print(f"Epoch [{epoch + 1}] Loss_ce {sums[0] / sums[2]:.3f} Loss_tr {sums[1] / sums[2]:.3f} "
                  f"Time {time.time() - start:.1f}s", flush=True)
        if (epoch + 1) % args.eval_step == 0 or epoch + 1 == args.max_epoch:
            if is_main:
                mAP, cmc = evaluate(model.module, query, gallery, test_transformer, device)
                print(f"Mean AP: {mAP:.1%}  top-1 {cmc[0]:.1%}  top-5 {cmc[4]:.1%}  top-10 {cmc[9]:.1%}")
                is_best = mAP > best_mAP
                best_mAP = max(mAP, best_mAP)
                state = {"state_dict": model.module.state_dict(), "epoch": epoch + 1, "best_mAP": best_mAP}
                torch.save(state, osp.join(args.logs_dir, "checkpoint.pth.tar"))
                if is_best:
                    torch.save(state, osp.join(args.logs_dir, "model_best.pth.tar"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
