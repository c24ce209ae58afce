"""SoftMatch (Chen et al., ICLR 2023) on STL-10: truncated-Gaussian sample weighting
of the pseudo-labels plus uniform alignment, WRN-37-2.

    torchrun --nproc_per_node=4 20_softmatch_stl10.py --data /datasets/stl10 --out runs/softmatch_stl
"""
import argparse
import math
import os
import shutil
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from lib.models import wrn_37_2
from lib.transforms import RandAugmentMC

MEAN, STD = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/stl10")
    p.add_argument("--out", default="runs/softmatch_stl10")
    p.add_argument("--fold", type=int, default=0, help="STL-10 predefined labelled fold (1000 images)")
    p.add_argument("--batch-size", type=int, default=16, help="labelled images per GPU")
    p.add_argument("--uratio", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--total-iters", type=int, default=1 << 20)
    p.add_argument("--eval-iters", type=int, default=8192)
    p.add_argument("--m", type=float, default=0.999, help="momentum of the confidence statistics")
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class StrongWeak:
    def __init__(self):
        base = [transforms.RandomCrop(96, padding=12, padding_mode="reflect"), transforms.RandomHorizontalFlip()]
        post = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
        self.weak = transforms.Compose(base + post)
        self.strong = transforms.Compose(base + [RandAugmentMC(n=2, m=10)] + post)

    def __call__(self, img):
        return self.weak(img), self.strong(img)


class SoftMatchWeighting:
    def __init__(self, num_classes, m, device):
        self.m = m
        self.mu = torch.tensor(1.0 / num_classes, device=device)
        self.var = torch.tensor(1.0, device=device)
        self.p_model = torch.full((num_classes,), 1.0 / num_classes, device=device)

    @torch.no_grad()
    def update(self, probs):
        max_p = probs.max(dim=-1).values
        stats = torch.cat([torch.stack([max_p.mean(), max_p.var(unbiased=True)]), probs.mean(0)])
        dist.all_reduce(stats, op=dist.ReduceOp.AVG)
        self.mu = self.m * self.mu + (1 - self.m) * stats[0]
        self.var = self.m * self.var + (1 - self.m) * stats[1]
        self.p_model = self.m * self.p_model + (1 - self.m) * stats[2:]

    @torch.no_grad()
    def align(self, probs):
        aligned = probs * (1.0 / probs.size(1)) / self.p_model
        return aligned / aligned.sum(dim=-1, keepdim=True)

    @torch.no_grad()
    def weights(self, probs):
        max_p = probs.max(dim=-1).values
        w = torch.exp(-((max_p - self.mu).clamp(max=0.0) ** 2) / (2 * self.var / 4))
        return w


def save_checkpoint(state, is_best, out_dir):
    path = os.path.join(out_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth.tar"))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        acc[0] += (net(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1] * 100).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    lab_tf = transforms.Compose([transforms.RandomCrop(96, padding=12, padding_mode="reflect"),
                                 transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                 transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    lab_set = datasets.STL10(args.data, split="train", folds=args.fold, transform=lab_tf)
    unl_set = datasets.STL10(args.data, split="train+unlabeled", transform=StrongWeak())
    test_set = datasets.STL10(args.data, split="test", transform=test_tf)
    # repeat the 1000 labelled images so that one labelled epoch covers many iterations
    lab_set = torch.utils.data.ConcatDataset([lab_set] * 50)

    lab_sampler = DistributedSampler(lab_set, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, args.batch_size * args.uratio, sampler=unl_sampler,
                            num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 256, num_workers=4)

    net = wrn_37_2(num_classes=10).to(device)
    ema_net = deepcopy(net).eval()
    for p in ema_net.parameters():
        p.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: math.cos(7 * math.pi * it / (16 * args.total_iters)))
    sm = SoftMatchWeighting(10, args.m, device)

    start, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema_net.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        sm.mu, sm.var = ck["mu"].to(device), ck["var"].to(device)
        sm.p_model = ck["p_model"].to(device)
        start, best = ck["it"], ck["best"]

    lab_ep = start // len(lab_loader)
    unl_ep = start // len(unl_loader)
    lab_sampler.set_epoch(lab_ep)
    unl_sampler.set_epoch(unl_ep)
    lab_iter, unl_iter = iter(lab_loader), iter(unl_loader)
    model.train()
    tic = time.time()
    for it in range(start, args.total_iters):
        try:
            x, y = next(lab_iter)
        except StopIteration:
            lab_ep += 1
            lab_sampler.set_epoch(lab_ep)
            lab_iter = iter(lab_loader)
            x, y = next(lab_iter)
        try:
            (u_w, u_s), _ = next(unl_iter)
        except StopIteration:
            unl_ep += 1
            unl_sampler.set_epoch(unl_ep)
            unl_iter = iter(unl_loader)
            (u_w, u_s), _ = next(unl_iter)

        n = x.size(0)
        logits = model(torch.cat([x, u_w, u_s]).to(device, non_blocking=True))
        y = y.to(device, non_blocking=True)
        logits_x, (logits_w, logits_s) = logits[:n], logits[n:].chunk(2)
        loss_x = F.cross_entropy(logits_x, y)

        probs = logits_w.detach().softmax(-1)
        sm.update(probs)
        probs = sm.align(probs)
        w = sm.weights(probs)
        loss_u = (F.cross_entropy(logits_s, probs.argmax(-1), reduction="none") * w).mean()
        loss = loss_x + args.lambda_u * loss_u

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for pe, pm in zip(ema_net.parameters(), model.module.parameters()):
                pe.mul_(args.ema).add_(pm.detach(), alpha=1 - args.ema)
            for be, bm in zip(ema_net.buffers(), model.module.buffers()):
                be.copy_(bm)

        if rank == 0 and (it + 1) % 256 == 0:
            print(f"it {it + 1}: lx {loss_x.item():.4f} lu {loss_u.item():.4f} w {w.mean().item():.3f} "
                  f"mu {sm.mu.item():.3f} {(time.time() - tic) / 256:.3f}s/it", flush=True)
            tic = time.time()

        if (it + 1) % args.eval_iters == 0:
            acc = evaluate(ema_net, test_loader, device)
            is_best = acc > best
            best = max(acc, best)
            save_checkpoint({"it": it + 1, "model": model.module.state_dict(), "ema": ema_net.state_dict(),
                             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             "mu": sm.mu.cpu(), "var": sm.var.cpu(), "p_model": sm.p_model.cpu(),
                             "best": best, "acc": acc}, is_best, args.out)
            if rank == 0:
                print(f"[eval] it {it + 1} ema acc {acc:.2f} best {best:.2f}", flush=True)
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
