"""iCaRL (Rebuffi et al., 2017) on CIFAR-100, 10 incremental steps of 10 classes.

- growing fully connected layer, sigmoid BCE with distillation on old classes
- exemplar memory of fixed size K, selected by herding
- nearest-mean-of-exemplars (NME) classifier for evaluation

    torchrun --nproc_per_node=4 07_icarl_herding.py --memory 2000
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
from torchvision import datasets, models, transforms

MEAN, STD = (0.5071, 0.4866, 0.4409), (0.2009, 0.1984, 0.2023)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--ckpt-dir", default="./ckpt/icarl")
    ap.add_argument("--increment", type=int, default=10)
    ap.add_argument("--memory", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=70)
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class ICaRLNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet34(weights=None)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        r.fc = nn.Identity()
        self.backbone = r
        self.feat_dim = 512
        self.fc = None

    def add_classes(self, n):
        old = self.fc
        out = n if old is None else old.out_features + n
        fc = nn.Linear(self.feat_dim, out)
        if old is not None:
            fc.weight.data[:old.out_features] = old.weight.data
            fc.bias.data[:old.out_features] = old.bias.data
        self.fc = fc.to(next(self.backbone.parameters()).device)

    def extract_features(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.backbone(x))


@torch.no_grad()
def features_of(extract, ds, device):
    loader = DataLoader(ds, batch_size=256, num_workers=2)
    feats = []
    for x, _ in loader:
        f = extract(x.to(device))
        feats.append(F.normalize(f, dim=1))
    return torch.cat(feats)


@torch.no_grad()
def herding_selection(model, class_ds, m, device):
    """Greedy herding: pick samples whose running mean best approximates the class mean."""
    feats = features_of(model.extract_features, class_ds, device)
    mu = feats.mean(0)
    chosen, running = [], torch.zeros_like(mu)
    for k in range(1, min(m, len(feats)) + 1):
        cand = mu - (running + feats) / k
        dists = cand.norm(dim=1)
        if chosen:
            dists[chosen] = float("inf")
        i = int(dists.argmin())
        chosen.append(i)
        running += feats[i]
    return chosen


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm])
    plain_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_aug = datasets.CIFAR100(args.root, train=True, transform=train_tf)
    train_plain = datasets.CIFAR100(args.root, train=True, transform=plain_tf)
    test_set = datasets.CIFAR100(args.root, train=False, transform=plain_tf)
    ytr, yte = np.array(train_aug.targets), np.array(test_set.targets)

    net = ICaRLNet().to(device)
    old_net = None
    exemplars = {}  # class -> list of train indices
    results = []

    for step, lo in enumerate(range(0, 100, args.increment)):
        new_classes = list(range(lo, lo + args.increment))
        n_old = lo
        net.add_classes(args.increment)
        model = DDP(net, device_ids=[local_rank])

        idx = np.where(np.isin(ytr, new_classes))[0].tolist()
        for c in sorted(exemplars):
            idx += exemplars[c]
        step_ds = Subset(train_aug, idx)
        sampler = DistributedSampler(step_ds, shuffle=True)
        loader = DataLoader(step_ds, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [49, 63], gamma=0.2)
        n_known = lo + args.increment

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                target = F.one_hot(y, n_known).float()
                if old_net is not None:
                    with torch.no_grad():
                        target[:, :n_old] = torch.sigmoid(old_net(x))
                loss = F.binary_cross_entropy_with_logits(logits, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and ep % 10 == 0:
                print(f"step {step} epoch {ep} loss {loss.item():.4f}", flush=True)

        # reduce old exemplar sets and build new ones; classes are split across ranks
        model.eval()
        m = args.memory // n_known
        for c in exemplars:
            exemplars[c] = exemplars[c][:m]
        mine = {}
        for c in new_classes[rank::world]:
            cls_idx = np.where(ytr == c)[0].tolist()
            pick = herding_selection(model, Subset(train_plain, cls_idx), m, device)
            mine[c] = [cls_idx[i] for i in pick]
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            exemplars.update(part)

        # NME evaluation, test set sharded across ranks
        net.eval()
        means = []
        for c in range(n_known):
            f = features_of(net.extract_features, Subset(train_plain, exemplars[c]), device)
            means.append(F.normalize(f.mean(0), dim=0))
        means = torch.stack(means)
        test_idx = np.where(yte < n_known)[0][rank::world].tolist()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in DataLoader(Subset(test_set, test_idx), batch_size=256, num_workers=2):
                f = F.normalize(net.extract_features(x.to(device)), dim=1)
                pred = torch.cdist(f, means).argmin(1)
                correct[0] += (pred.cpu() == y).sum().item()
                correct[1] += len(y)
        dist.all_reduce(correct)
        acc = 100.0 * (correct[0] / correct[1]).item()
        results.append(acc)
        if rank == 0:
            print(f"== step {step}: {n_known} classes, NME acc {acc:.2f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"net": net.state_dict(), "exemplars": exemplars, "acc": results},
                       os.path.join(args.ckpt_dir, f"icarl_step{step}.pt"))

        old_net = copy.deepcopy(net).eval()
        for p in old_net.parameters():
            p.requires_grad = False
        dist.barrier()

    if rank == 0:
        print("accuracies:", [f"{a:.2f}" for a in results], "avg:", f"{np.mean(results):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
