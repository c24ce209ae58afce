"""DANN for digits: MNIST (source) -> USPS (target).

    torchrun --standalone --nproc_per_node=2 11_dann_mnist_usps.py --epochs 40

Source and target batches go through the network in two separate forward passes;
buffers are not re-broadcast by DDP because BatchNorm is synchronised instead.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/data/digits")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="per domain, per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=10.0)
    p.add_argument("--dom-weight", type=float, default=0.3)
    p.add_argument("--ckpt", default="/shared/ckpt/dann_m2u")
    return p.parse_args()


class ReverseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.neg() * ctx.lam, None


class DigitDANN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 48, 5), nn.BatchNorm2d(48), nn.Dropout2d(), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten())
        self.label_head = nn.Sequential(nn.Linear(48 * 4 * 4, 100), nn.BatchNorm1d(100), nn.ReLU(),
                                        nn.Linear(100, 100), nn.BatchNorm1d(100), nn.ReLU(), nn.Linear(100, 10))
        self.domain_head = nn.Sequential(nn.Linear(48 * 4 * 4, 100), nn.BatchNorm1d(100), nn.ReLU(),
                                         nn.Linear(100, 1))

    def forward(self, x, lam=0.0):
        f = self.features(x)
        return self.label_head(f), self.domain_head(ReverseGrad.apply(f, lam))


def digit_transforms():
    return transforms.Compose([transforms.Resize(28), transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])


def evaluate(model, loader, device):
    model.eval()
    correct, seen = 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits, _ = model(x.to(device))
            correct += (logits.argmax(1).cpu() == y).sum().item()
            seen += y.numel()
    # shards are unpadded and may differ in size, so gather raw counts
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (correct, seen))
    model.train()
    return 100.0 * sum(c for c, _ in gathered) / sum(n for _, n in gathered)


def main():
    args = options()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        datasets.USPS(args.data, train=True, download=True)
        datasets.USPS(args.data, train=False, download=True)
    dist.barrier()

    tf = digit_transforms()
    mnist = datasets.MNIST(args.data, train=True, transform=tf)
    usps = datasets.USPS(args.data, train=True, transform=tf)
    usps_test = datasets.USPS(args.data, train=False, transform=tf)
    src_sampler = DistributedSampler(mnist, shuffle=True, drop_last=True)
    tgt_sampler = DistributedSampler(usps, shuffle=True, drop_last=True)
    src_loader = DataLoader(mnist, args.batch_size, sampler=src_sampler, num_workers=4, drop_last=True)
    tgt_loader = DataLoader(usps, args.batch_size, sampler=tgt_sampler, num_workers=2, drop_last=True)
    test_idx = list(range(rank, len(usps_test), world))
    test_loader = DataLoader(torch.utils.data.Subset(usps_test, test_idx), 256, num_workers=2)

    model = DigitDANN()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)

    steps_per_epoch = len(src_loader)
    total_steps = steps_per_epoch * args.epochs
    tgt_epoch = 0
    tgt_sampler.set_epoch(tgt_epoch)
    tgt_iter = iter(tgt_loader)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        src_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xs, ys in src_loader:
            try:
                xt, _ = next(tgt_iter)
            except StopIteration:
                tgt_epoch += 1
                tgt_sampler.set_epoch(tgt_epoch)
                tgt_iter = iter(tgt_loader)
                xt, _ = next(tgt_iter)
            p = step / total_steps
            # lambda ramps up from 0: the domain head is in the graph from the first step
            lam = 2.0 / (1.0 + float(torch.exp(torch.tensor(-args.gamma * p)))) - 1.0
            lr = args.lr / (1.0 + 10 * p) ** 0.75
            for g in optimizer.param_groups:
                g["lr"] = lr

            xs, ys, xt = xs.to(device), ys.to(device), xt.to(device)
            cls_s, dom_s = model(xs, lam)
            _, dom_t = model(xt, lam)
            loss_cls = F.cross_entropy(cls_s, ys)
            loss_dom = F.binary_cross_entropy_with_logits(dom_s, torch.zeros_like(dom_s)) + \
                F.binary_cross_entropy_with_logits(dom_t, torch.ones_like(dom_t))
            loss = loss_cls + args.dom_weight * loss_dom

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"step {step}/{total_steps} cls {loss_cls.item():.4f} dom {loss_dom.item():.4f} "
                      f"lam {lam:.3f} lr {lr:.5f}", flush=True)

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: USPS test acc {acc:.2f}  ({time.time() - t0:.1f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.ckpt, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "acc": acc},
                           os.path.join(args.ckpt, "best.pt"))
        dist.barrier()

    # reload the best weights on every rank for a final check
    state = torch.load(os.path.join(args.ckpt, "best.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    final = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"best epoch {state['epoch']} acc {final:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
