"""Two-stage UDA on DomainNet (real -> sketch) with Minimum Class Confusion.

stage 1 (source only):
    torchrun --nproc_per_node=4 14_mcc_domainnet_two_stage.py --stage source --out work/dn_r2s
stage 2 (adaptation, initialised from stage 1):
    torchrun --nproc_per_node=4 14_mcc_domainnet_two_stage.py --stage adapt --init work/dn_r2s/source_final.pth --out work/dn_r2s
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["source", "adapt"], required=True)
    ap.add_argument("--root", default="/datasets/domainnet")
    ap.add_argument("--src", default="real")
    ap.add_argument("--tgt", default="sketch")
    ap.add_argument("--init", default="")
    ap.add_argument("--out", default="work/dn")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--iters-per-epoch", type=int, default=2500)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--mcc-temp", type=float, default=2.5)
    ap.add_argument("--mcc-weight", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class ListDataset(Dataset):
    def __init__(self, root, list_path, transform):
        self.root, self.transform = root, transform
        with open(list_path) as f:
            self.items = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.transform(Image.open(os.path.join(self.root, p)).convert("RGB")), y


class Classifier(nn.Module):
    def __init__(self, num_classes=345):
        super().__init__()
        backbone = models.resnet101(weights=models.ResNet101_Weights.IMAGENET1K_V1)
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.bottleneck = nn.Sequential(nn.Linear(2048, 1024), nn.BatchNorm1d(1024), nn.ReLU())
        self.head = nn.Linear(1024, num_classes)

    def forward(self, x):
        return self.head(self.bottleneck(self.backbone(x)))


def mcc_loss(logits, temperature):
    b, c = logits.shape
    probs = F.softmax(logits / temperature, dim=1)
    ent = -(probs * torch.log(probs + 1e-5)).sum(1)
    w = (1 + torch.exp(-ent)).detach()
    w = (b * w / w.sum()).unsqueeze(1)
    confusion = (probs * w).t() @ probs
    confusion = confusion / confusion.sum(1, keepdim=True)
    return (confusion.sum() - confusion.trace()) / c


def cycle(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for batch in loader:
            yield batch
        ep += 1


def save_checkpoint(model, optimizer, epoch, path):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.3, 0.3, 0.3), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = ListDataset(args.root, os.path.join(args.root, f"{args.src}_train.txt"), train_tf)
    tgt = ListDataset(args.root, os.path.join(args.root, f"{args.tgt}_train.txt"), train_tf)
    tgt_test = ListDataset(args.root, os.path.join(args.root, f"{args.tgt}_test.txt"), test_tf)

    src_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    tgt_sampler = DistributedSampler(tgt, shuffle=True, drop_last=True)
    src_stream = cycle(DataLoader(src, args.bs, sampler=src_sampler, num_workers=args.workers,
                                  pin_memory=True, drop_last=True), src_sampler)
    tgt_stream = cycle(DataLoader(tgt, args.bs, sampler=tgt_sampler, num_workers=args.workers,
                                  pin_memory=True, drop_last=True), tgt_sampler)
    test_loader = DataLoader(torch.utils.data.Subset(tgt_test, range(rank, len(tgt_test), world)), 128,
                             num_workers=args.workers, pin_memory=True)

    net = Classifier()
    if args.stage == "adapt":
        state = torch.load(args.init, map_location="cpu")
        net.load_state_dict(state["model"])
        if rank == 0:
            print(f"initialised from {args.init} (source epoch {state['epoch']})", flush=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD([
        {"params": net.backbone.parameters(), "lr": 0.1 * args.lr},
        {"params": list(net.bottleneck.parameters()) + list(net.head.parameters()), "lr": args.lr},
    ], momentum=0.9, weight_decay=5e-4, nesterov=True)
    base = [g["lr"] for g in optimizer.param_groups]
    total = args.epochs * args.iters_per_epoch

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        for it in range(args.iters_per_epoch):
            progress = (epoch * args.iters_per_epoch + it) / total
            for g, b in zip(optimizer.param_groups, base):
                g["lr"] = b * (1 + 10 * progress) ** -0.75
            xs, ys = next(src_stream)
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            if args.stage == "source":
                loss = F.cross_entropy(model(xs), ys, label_smoothing=0.1)
                transfer = torch.zeros((), device=device)
            else:
                xt, _ = next(tgt_stream)
                xt = xt.to(device, non_blocking=True)
                logits = model(torch.cat([xs, xt]))
                ce = F.cross_entropy(logits[: xs.size(0)], ys)
                transfer = mcc_loss(logits[xs.size(0):], args.mcc_temp)
                loss = ce + args.mcc_weight * transfer
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{args.stage}] ep {epoch} it {it} loss {loss.item():.4f} "
                      f"mcc {transfer.item():.4f}", flush=True)

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                pred = model(x.to(device, non_blocking=True)).argmax(1)
                hits[0] += (pred == y.to(device)).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        acc = 100.0 * (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"[{args.stage}] epoch {epoch} {args.tgt} acc {acc:.2f}", flush=True)
            if acc > best:
                best = acc
                save_checkpoint(model, optimizer, epoch, os.path.join(args.out, f"{args.stage}_best.pth"))
            save_checkpoint(model, optimizer, epoch, os.path.join(args.out, f"{args.stage}_final.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
