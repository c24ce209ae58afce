"""CDAN+E (Long et al., 2018) on Office-Home, ResNet-50.

torchrun --nproc_per_node=4 09_cdan_officehome.py --src Art --tgt Clipart --out logs/cdan_A2C
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder


def arg_parser():
    p = argparse.ArgumentParser("CDAN Office-Home")
    p.add_argument("--root", default="/datasets/OfficeHomeDataset_10072016")
    p.add_argument("--src", default="Art")
    p.add_argument("--tgt", default="Clipart")
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--test-interval", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="logs/cdan")
    return p


class GradientReverseLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coeff * grad, None


class CDANModel(nn.Module):
    def __init__(self, num_classes, bottleneck=256):
        super().__init__()
        resnet = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        resnet.fc = nn.Identity()
        self.backbone = resnet
        self.bottleneck = nn.Sequential(nn.Linear(2048, bottleneck), nn.BatchNorm1d(bottleneck), nn.ReLU())
        self.fc = nn.Linear(bottleneck, num_classes)
        self.disc = nn.Sequential(nn.Linear(bottleneck * num_classes, 1024), nn.ReLU(), nn.Dropout(0.5),
                                  nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 1))

    def forward(self, x, coeff=0.0):
        f = self.bottleneck(self.backbone(x))
        logits = self.fc(f)
        # multilinear map f (x) g, conditioned on the detached softmax
        g = F.softmax(logits, dim=1).detach()
        h = torch.bmm(g.unsqueeze(2), f.unsqueeze(1)).flatten(1)
        d = self.disc(GradientReverseLayer.apply(h, coeff))
        return logits, d, g


def entropy(p):
    return -(p * torch.log(p + 1e-5)).sum(1)


def cdan_e_loss(d, g, n_src, coeff):
    ent = entropy(g)
    w = 1.0 + torch.exp(-GradientReverseLayer.apply(ent, coeff))
    w_src, w_tgt = w[:n_src], w[n_src:]
    w = torch.cat([w_src / w_src.sum(), w_tgt / w_tgt.sum()]).detach()
    y = torch.cat([torch.ones(n_src), torch.zeros(d.size(0) - n_src)]).to(d.device)
    return (w * F.binary_cross_entropy_with_logits(d.squeeze(1), y, reduction="none")).sum() / w.sum()


class ForeverLoader:
    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.epoch = loader, sampler, 0
        self.it = iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


def test(model, loader, device):
    model.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, _, _ = model(x)
            correct += (logits.argmax(1) == y).sum().item()
            total += y.size(0)
    model.train()
    return 100.0 * correct / total


def main():
    args = arg_parser().parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("cdan")
    torch.manual_seed(2)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src_ds = ImageFolder(os.path.join(args.root, args.src), train_tf)
    tgt_ds = ImageFolder(os.path.join(args.root, args.tgt), train_tf)
    tgt_test_ds = ImageFolder(os.path.join(args.root, args.tgt), test_tf)
    num_classes = len(src_ds.classes)

    src_sampler = DistributedSampler(src_ds, shuffle=True)
    tgt_sampler = DistributedSampler(tgt_ds, shuffle=True)
    src_iter = ForeverLoader(DataLoader(src_ds, args.batch_size, sampler=src_sampler, num_workers=args.workers,
                                        drop_last=True, pin_memory=True), src_sampler)
    tgt_iter = ForeverLoader(DataLoader(tgt_ds, args.batch_size, sampler=tgt_sampler, num_workers=args.workers,
                                        drop_last=True, pin_memory=True), tgt_sampler)
    test_loader = DataLoader(tgt_test_ds, 64, sampler=DistributedSampler(tgt_test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    net = CDANModel(num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    groups = [{"params": net.backbone.parameters(), "lr_mult": 0.1},
              {"params": list(net.bottleneck.parameters()) + list(net.fc.parameters()), "lr_mult": 1.0},
              {"params": net.disc.parameters(), "lr_mult": 1.0}]
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    net = DDP(net, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    history, best_acc = [], 0.0
    tic = time.time()
    for it in range(1, args.iters + 1):
        lr = args.lr * (1 + 0.001 * it) ** (-0.75)
        for g in optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
        coeff = 2.0 / (1.0 + torch.exp(torch.tensor(-10.0 * it / args.iters)).item()) - 1.0

        xs, ys = src_iter.next()
        xt, _ = tgt_iter.next()
        xs, ys, xt = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True), xt.to(device, non_blocking=True)
        logits, d, g = net(torch.cat([xs, xt]), coeff)
        cls_loss = F.cross_entropy(logits[: xs.size(0)], ys)
        transfer_loss = cdan_e_loss(d, g, xs.size(0), coeff)
        loss = cls_loss + transfer_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if rank == 0 and it % 100 == 0:
            log.info("it %d cls %.4f transfer %.4f lr %.5f coeff %.3f (%.1fs)", it, cls_loss.item(),
                     transfer_loss.item(), lr, coeff, time.time() - tic)
            tic = time.time()

        if it % args.test_interval == 0 or it == args.iters:
            acc = test(net, test_loader, device)
            if rank == 0:
                history.append({"iter": it, "target_acc": acc})
                log.info("it %d %s->%s target acc %.2f", it, args.src, args.tgt, acc)
                if acc > best_acc:
                    best_acc = acc
                    torch.save({"iter": it, "model": net.module.state_dict(), "acc": acc},
                               os.path.join(args.out, "best.pth"))
                with open(os.path.join(args.out, "history.json"), "w") as fh:
                    json.dump({"best": best_acc, "history": history}, fh, indent=1)

    if rank == 0:
        log.info("done. best target acc %.2f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
