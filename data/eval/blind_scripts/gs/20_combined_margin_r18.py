# Combined-margin softmax (m1, m2, m3) ablation on VGGFace2 with IR-18.
# The classifier is sharded over the GPUs the same way as for the million-identity runs so the
# code path is identical; only the dataset is small.
#
#   torchrun --nproc_per_node=4 train_combined_r18.py --m1 1.0 --m2 0.3 --m3 0.2 --tag m2_0.3_m3_0.2
import argparse
import json
import logging
import math
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from backbones.iresnet import iresnet18
from partial_fc_v2 import AllGather, DistCrossEntropy

logger = logging.getLogger("ablation")


class CombinedMarginShard(nn.Module):
    def __init__(self, num_classes, dim, s, m1, m2, m3):
        super().__init__()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dim, self.s, self.m1, self.m2, self.m3 = dim, s, m1, m2, m3
        q, r = divmod(num_classes, self.world)
        self.num_local = q + int(self.rank < r)
        self.class_start = q * self.rank + min(self.rank, r)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, dim)))
        self.loss = DistCrossEntropy()

    def forward(self, x, y):
        n = x.size(0)
        x = torch.cat(AllGather(x, *[torch.zeros(n, self.dim, device=x.device) for _ in range(self.world)]))
        ys = [torch.zeros(n, dtype=torch.long, device=y.device) for _ in range(self.world)]
        dist.all_gather(ys, y)
        y = torch.cat(ys).view(-1, 1)
        own = (y >= self.class_start) & (y < self.class_start + self.num_local)
        y[~own] = -1
        y[own] -= self.class_start

        cos = F.linear(F.normalize(x), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        rows = torch.where(y != -1)[0]
        t = cos[rows, y[rows].view(-1)]
        theta = torch.acos(t)
        target = torch.cos(self.m1 * theta + self.m2) - self.m3
        # keep the target logit monotonic in theta for large angles
        target = torch.where(self.m1 * theta + self.m2 < math.pi, target,
                             t - self.m3 - math.sin(math.pi - self.m2) * self.m2)
        cos[rows, y[rows].view(-1)] = target
        return self.loss(cos * self.s, y)


def load_val(path):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    imgs = np.stack([cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), 1), cv2.COLOR_BGR2RGB) for b in bins])
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), np.asarray(issame)


@torch.no_grad()
def evaluate(model, imgs, issame, device):
    model.eval()
    embs = []
    for i in range(0, len(imgs), 512):
        x = imgs[i:i + 512].to(device).float().div(255).sub(0.5).div(0.5)
        embs.append(F.normalize(model(x) + model(x.flip(3))).cpu())
    model.train()
    e = torch.cat(embs)
    sims = (e[0::2] * e[1::2]).sum(1).numpy()
    return max(((sims > t) == issame).mean() for t in np.arange(-1, 1, 0.004))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/vggface2/train_112x112")
    ap.add_argument("--val", nargs="+", default=["/data/vggface2/lfw.bin", "/data/vggface2/cfp_fp.bin"])
    ap.add_argument("--m1", type=float, default=1.0)
    ap.add_argument("--m2", type=float, default=0.3)
    ap.add_argument("--m3", type=float, default=0.2)
    ap.add_argument("--scale", type=float, default=64.0)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--tag", default="default")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join("ablations", args.tag)
    os.makedirs(out_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=3407)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(iresnet18(num_features=512).to(device), device_ids=[local_rank], broadcast_buffers=False)
    head = CombinedMarginShard(len(train_set.classes), 512, args.scale, args.m1, args.m2, args.m3).to(device)
    lr = args.lr * args.batch_size * world / 1024
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": head.parameters()}],
                          lr=lr, momentum=0.9, weight_decay=5e-4)
    total = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1,
                                                anneal_strategy="cos", div_factor=25.0)

    val_sets = {os.path.basename(p)[:-4]: load_val(p) for p in args.val} if rank == 0 else {}
    history, best = [], 0.0
    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = head(model(img), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                logger.info("[%s] epoch %d step %d/%d loss %.4f lr %.5f", args.tag, epoch, step, total,
                            loss.item(), sched.get_last_lr()[0])

        if rank == 0:
            accs = {name: float(evaluate(model.module, *v, device)) for name, v in val_sets.items()}
            history.append({"epoch": epoch, "loss": loss.item(), "time": time.time() - t0, **accs})
            logger.info("[%s] epoch %d %s", args.tag, epoch, accs)
            mean_acc = float(np.mean(list(accs.values())))
            if mean_acc > best:
                best = mean_acc
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
            with open(os.path.join(out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
