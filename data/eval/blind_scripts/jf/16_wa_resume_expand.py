"""Weight Aligning (Zhao et al., CVPR 2020) for class-incremental CIFAR-100, 10 x 10 classes.

KD from the previous step's model + exemplar replay, then the norms of the new
class weights are aligned to the old ones after every step. Runs are long, so
the script can resume from the checkpoint written at the end of any step.

    torchrun --nproc_per_node=4 16_wa_resume_expand.py --out /nfs/wa_c100
    torchrun --nproc_per_node=4 16_wa_resume_expand.py --out /nfs/wa_c100 --resume /nfs/wa_c100/step_4.pt
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet34


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/nfs/datasets/cifar100")
    p.add_argument("--out", default="/nfs/wa_c100")
    p.add_argument("--resume", default="")
    p.add_argument("--increment", type=int, default=10)
    p.add_argument("--memory", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=170)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=2.0)
    return p.parse_args()


class IncrementalNet(nn.Module):
    def __init__(self):
        super().__init__()
        bb = resnet34()
        bb.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        bb.maxpool = nn.Identity()
        bb.fc = nn.Identity()
        self.backbone = bb
        self.fc = nn.Linear(512, 0)

    @property
    def n_classes(self):
        return self.fc.out_features

    def expand_to(self, n):
        if n <= self.n_classes:
            return
        old = self.fc
        fc = nn.Linear(512, n).to(old.weight.device)
        with torch.no_grad():
            fc.weight[:old.out_features] = old.weight
            fc.bias[:old.out_features] = old.bias
        self.fc = fc

    @torch.no_grad()
    def align_weights(self, n_old):
        w = self.fc.weight
        gamma = w[:n_old].norm(dim=1).mean() / w[n_old:].norm(dim=1).mean()
        w[n_old:] *= gamma
        return gamma.item()

    def forward(self, x):
        return self.fc(self.backbone(x))


@torch.no_grad()
def evaluate(net, test_set, y_test, n_known, device, rank, world):
    net.eval()
    idx = np.where(y_test < n_known)[0][rank::world]
    s = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, idx), batch_size=500, num_workers=4):
        x, y = x.to(device), y.to(device)
        s[0] += (net(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return 100.0 * (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
    train_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR100(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)

    net = IncrementalNet().to(device)
    start_step, memory, history = 0, [], []
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        start_step = ckpt["step"] + 1
        memory, history = ckpt["memory"], ckpt["history"]
        if rank == 0:
            # DDP broadcasts rank 0's parameters when the model is wrapped
            net.expand_to(ckpt["n_classes"])
            net.load_state_dict(ckpt["model"])
        print(f"[rank {rank}] resuming at step {start_step}", flush=True)
    old_net = copy.deepcopy(net).eval().requires_grad_(False) if start_step > 0 else None

    n_steps = 100 // args.increment
    for step in range(start_step, n_steps):
        n_old = step * args.increment
        n_known = n_old + args.increment
        net.expand_to(net.n_classes + args.increment)
        model = DDP(net, device_ids=[local_rank])

        idx = np.where((y_train >= n_old) & (y_train < n_known))[0].tolist() + memory
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [60, 120, 160], gamma=0.1)
        lam = n_old / n_known

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        old_logits = old_net(x)
                    kd = F.kl_div(F.log_softmax(logits[:, :n_old] / args.T, 1),
                                  F.softmax(old_logits / args.T, 1), reduction="batchmean") * args.T ** 2
                    loss = (1 - lam) * loss + lam * kd
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                # weight clipping: keep the classifier non-negative
                with torch.no_grad():
                    net.fc.weight.clamp_(min=0)
            sched.step()
            if rank == 0 and ep % 20 == 0:
                print(f"step {step} ep {ep} loss {loss.item():.4f}", flush=True)

        if step > 0:
            gamma = net.align_weights(n_old)
            if rank == 0:
                print(f"step {step}: aligned new weights with gamma={gamma:.4f}")

        acc = evaluate(net, test_set, y_test, n_known, device, rank, world)
        history.append(acc)

        # herding-free exemplars: random, identical on all ranks
        m = args.memory // n_known
        g = np.random.RandomState(step)
        memory = []
        for c in range(n_known):
            memory += g.choice(np.where(y_train == c)[0], m, replace=False).tolist()

        if rank == 0:
            print(f"== step {step}: {n_known} classes acc {acc:.2f} avg {np.mean(history):.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "n_classes": net.n_classes, "step": step,
                        "memory": memory, "history": history}, os.path.join(args.out, f"step_{step}.pt"))
        old_net = copy.deepcopy(net).eval().requires_grad_(False)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
