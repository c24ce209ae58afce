"""ImageNet-LT decoupling baselines in one script (Kang et al., ICLR 2020).

  --mode joint : instance-balanced end-to-end training of ResNeXt-50 (stage 1);
                 at the end also reports tau-normalised classifier accuracy (no training).
  --mode lws   : learnable weight scaling on top of a joint checkpoint (stage 2).

    torchrun --nproc_per_node=8 imagenetlt_decoupled_net.py --mode joint --out runs/joint
    torchrun --nproc_per_node=8 imagenetlt_decoupled_net.py --mode lws --init runs/joint/model.pth --out runs/lws
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class DecoupledNet(nn.Module):
    def __init__(self, num_classes=1000, mode="joint"):
        super().__init__()
        trunk = torchvision.models.resnext50_32x4d()
        trunk.fc = nn.Identity()
        self.backbone = trunk
        self.fc = nn.Linear(2048, num_classes)
        self.lws = nn.Parameter(torch.ones(num_classes))
        self.mode = mode

    def forward(self, x):
        logits = self.fc(self.backbone(x))
        if self.mode == "lws":
            logits = logits * self.lws
        return logits


class ImageList(Dataset):
    def __init__(self, root, txt, train):
        self.root = root
        with open(txt) as f:
            self.items = [(a, int(b)) for a, b in (l.split() for l in f if l.strip())]
        self.targets = np.array([b for _, b in self.items])
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        aug = [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
               transforms.ColorJitter(0.4, 0.4, 0.4)] if train else [transforms.Resize(256), transforms.CenterCrop(224)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, path)).convert("RGB")), y


class ClassBalancedSampler(Sampler):
    def __init__(self, targets, rank, world, seed=0):
        self.targets, self.rank, self.world, self.seed, self.epoch = targets, rank, world, seed, 0
        self.buckets = [np.flatnonzero(targets == c) for c in np.unique(targets)]
        self.n = len(targets) // world

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        cls = rng.randint(len(self.buckets), size=self.n * self.world)
        idx = [self.buckets[c][rng.randint(len(self.buckets[c]))] for c in cls]
        return iter(idx[self.rank::self.world])

    def __len__(self):
        return self.n


@torch.no_grad()
def evaluate(net, loader, counts, device, weight_override=None):
    net.eval()
    C = len(counts)
    hit = torch.zeros(C, device=device)
    tot = torch.zeros(C, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if weight_override is None:
            logits = net(x)
        else:
            logits = F.linear(net.backbone(x), weight_override, net.fc.bias)
        pred = logits.argmax(1)
        tot += torch.bincount(y, minlength=C)
        hit += torch.bincount(y, weights=(pred == y).float(), minlength=C)
    dist.all_reduce(hit)
    dist.all_reduce(tot)
    acc = (hit / tot.clamp(min=1)).cpu().numpy()
    return (hit.sum() / tot.sum()).item(), acc[counts > 100].mean(), \
        acc[(counts >= 20) & (counts <= 100)].mean(), acc[counts < 20].mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["joint", "lws"], default="joint")
    ap.add_argument("--init", default=None)
    ap.add_argument("--root", default="/data/ILSVRC/Data/CLS-LOC")
    ap.add_argument("--lists", default="/data/ImageNet_LT")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tau", type=float, default=1.0, help="tau-norm exponent")
    args = ap.parse_args()
    epochs, base_lr = (90, 0.2) if args.mode == "joint" else (10, 0.2)  # lr at total batch 512

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    log = logging.getLogger("decouple")

    train_set = ImageList(args.root, os.path.join(args.lists, "ImageNet_LT_train.txt"), train=True)
    test_set = ImageList(args.root, os.path.join(args.lists, "ImageNet_LT_test.txt"), train=False)
    counts = np.bincount(train_set.targets, minlength=1000)

    if args.mode == "joint":
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    else:
        sampler = ClassBalancedSampler(train_set.targets, rank, world)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=250, num_workers=args.workers, pin_memory=True)

    net = DecoupledNet(1000, mode=args.mode)
    if args.mode == "lws":
        sd = torch.load(args.init, map_location="cpu")
        net.load_state_dict(sd)
        for name, p in net.named_parameters():
            p.requires_grad = name == "lws"
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    lr = base_lr * args.batch_size * world / 512
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                                momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_loader))

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        if args.mode == "lws":
            model.module.backbone.eval()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 200 == 0:
                log.info("[%s] epoch %d it %d/%d loss %.4f", args.mode, epoch, it, len(train_loader), loss.item())

        if epoch % 10 == 9 or epoch == epochs - 1:
            top1, many, med, few = evaluate(model.module, test_loader, counts, device)
            log.info("[%s] epoch %d: top1 %.2f many %.2f medium %.2f few %.2f",
                     args.mode, epoch, 100 * top1, 100 * many, 100 * med, 100 * few)
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "model.pth"))

    if args.mode == "joint":
        w = model.module.fc.weight.detach()
        w_tau = w / w.norm(dim=1, keepdim=True).pow(args.tau)
        top1, many, med, few = evaluate(model.module, test_loader, counts, device, weight_override=w_tau)
        log.info("[tau-norm tau=%.1f] top1 %.2f many %.2f medium %.2f few %.2f",
                 args.tau, 100 * top1, 100 * many, 100 * med, 100 * few)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
