# DANN on VisDA-2017 (synthetic -> real), ResNet-101, mean per-class accuracy on the target.
#
#   torchrun --nnodes=1 --nproc_per_node=8 06_dann_visda.py --root /mnt/visda2017 --epochs 20
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models, transforms
from PIL import Image

CLASSES = ["aeroplane", "bicycle", "bus", "car", "horse", "knife", "motorcycle",
           "person", "plant", "skateboard", "train", "truck"]


class ImageList(Dataset):
    """Reads VisDA's image_list.txt: '<relative path> <label>' per line."""

    def __init__(self, root, list_file, transform):
        self.root = root
        with open(os.path.join(root, list_file)) as f:
            self.samples = [(p, int(l)) for p, l in (line.split() for line in f if line.strip())]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class GRL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lambd):
        ctx.lambd = lambd
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -ctx.lambd * g, None


class Net(nn.Module):
    def __init__(self, num_classes=12):
        super().__init__()
        r = models.resnet101(weights=models.ResNet101_Weights.IMAGENET1K_V2)
        self.encoder = nn.Sequential(*list(r.children())[:-1], nn.Flatten())
        self.bottleneck = nn.Sequential(nn.Linear(2048, 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True), nn.Dropout(0.5))
        self.classifier = nn.Linear(256, num_classes)
        self.discriminator = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                           nn.Linear(1024, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                           nn.Linear(1024, 2))

    def forward(self, x, lambd=0.0):
        z = self.bottleneck(self.encoder(x))
        return self.classifier(z), self.discriminator(GRL.apply(z, lambd))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/visda2017")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=32, help="per-GPU batch for each domain")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gamma", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--logdir", default="runs/dann_visda")
    return ap.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)
    torch.manual_seed(0)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf_train = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    tf_test = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = ImageList(os.path.join(args.root, "train"), "image_list.txt", tf_train)
    tgt = ImageList(os.path.join(args.root, "validation"), "image_list.txt", tf_train)
    tgt_eval = ImageList(os.path.join(args.root, "validation"), "image_list.txt", tf_test)

    src_sampler = DistributedSampler(src, shuffle=True, seed=0)
    tgt_sampler = DistributedSampler(tgt, shuffle=True, seed=1)
    src_loader = DataLoader(src, args.bs, sampler=src_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    tgt_loader = DataLoader(tgt, args.bs, sampler=tgt_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(Subset(tgt_eval, range(rank, len(tgt_eval), world)), 128, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    net = Net(len(CLASSES)).to(dev)
    params = [{"params": net.encoder.parameters(), "lr": args.lr},
              {"params": list(net.bottleneck.parameters()) + list(net.classifier.parameters()), "lr": 10 * args.lr},
              {"params": net.discriminator.parameters(), "lr": 10 * args.lr}]
    opt = torch.optim.SGD(params, momentum=0.9, weight_decay=5e-4, nesterov=True)
    init_lr = [g["lr"] for g in opt.param_groups]
    net = DDP(net, device_ids=[lr_])

    tb = SummaryWriter(args.logdir) if rank == 0 else None
    steps = min(len(src_loader), len(tgt_loader))
    total = steps * args.epochs
    gstep = 0
    best_mca = 0.0
    for epoch in range(args.epochs):
        src_sampler.set_epoch(epoch)
        net.train()
        tic = time.time()
        for (xs, ys), (xt, _) in zip(src_loader, tgt_loader):
            p = gstep / total
            lambd = 2.0 / (1.0 + torch.exp(torch.tensor(-args.gamma * p)).item()) - 1.0
            for g, l0 in zip(opt.param_groups, init_lr):
                g["lr"] = l0 / (1.0 + 10 * p) ** 0.75

            xs, ys, xt = xs.to(dev, non_blocking=True), ys.to(dev, non_blocking=True), xt.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                cls_out, dom_out = net(torch.cat([xs, xt]), lambd)
                loss_cls = F.cross_entropy(cls_out[: xs.size(0)], ys)
                dom_y = torch.cat([torch.zeros(xs.size(0)), torch.ones(xt.size(0))]).long().to(dev)
                loss_dom = F.cross_entropy(dom_out, dom_y)
                loss = loss_cls + loss_dom
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            gstep += 1
            if tb is not None and gstep % 50 == 0:
                tb.add_scalar("loss/cls", loss_cls.item(), gstep)
                tb.add_scalar("loss/domain", loss_dom.item(), gstep)
                tb.add_scalar("lambda", lambd, gstep)

        # mean class accuracy over the whole target set
        net.eval()
        conf = torch.zeros(len(CLASSES), len(CLASSES), device=dev, dtype=torch.long)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in eval_loader:
                pred = net(x.to(dev, non_blocking=True))[0].argmax(1)
                y = y.to(dev)
                conf.index_put_((y, pred), torch.ones_like(y), accumulate=True)
        dist.all_reduce(conf)
        per_class = conf.diag().float() / conf.sum(1).clamp(min=1).float()
        mca = per_class.mean().item() * 100
        if rank == 0:
            print(f"epoch {epoch} mean-class-acc {mca:.2f} | " +
                  " ".join(f"{c}:{a * 100:.1f}" for c, a in zip(CLASSES, per_class.tolist())) +
                  f" | {time.time() - tic:.0f}s", flush=True)
            tb.add_scalar("target/mca", mca, epoch)
            ckpt = {"epoch": epoch, "model": net.module.state_dict(), "opt": opt.state_dict(), "mca": mca}
            torch.save(ckpt, os.path.join(args.logdir, "last.pth"))
            if mca > best_mca:
                best_mca = mca
                torch.save(ckpt, os.path.join(args.logdir, "best.pth"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
