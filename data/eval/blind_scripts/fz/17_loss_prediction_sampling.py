"""Hard-example sampling driven by a learned loss-prediction module
(in the spirit of Yoo & Kweon, "Learning Loss for Active Learning").

A small LossNet reads intermediate features of the backbone and predicts the
target loss of each sample.  Once it has been switched on (`--lossnet-start`),
its predictions over the training set are used as sampling weights, which is
much cheaper than a full scoring pass with the true loss.

    torchrun --nproc_per_node=4 17_loss_prediction_sampling.py --epochs 200 --lossnet-start 20
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset


class Indexed(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


class SharedSeedWeightedSampler(Sampler):
    def __init__(self, n, num_replicas, rank, seed=0):
        self.weights = torch.ones(n, dtype=torch.double)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.num_samples = math.ceil(n / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(self.weights, self.num_samples * self.num_replicas, replacement=True, generator=g)
        return iter(draw[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class LossNet(nn.Module):
    def __init__(self, channels=(64, 128, 256, 512), dim=128):
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(c, dim) for c in channels])
        self.out = nn.Linear(dim * len(channels), 1)

    def forward(self, feats):
        h = [F.relu(fc(F.adaptive_avg_pool2d(f, 1).flatten(1))) for fc, f in zip(self.fcs, feats)]
        return self.out(torch.cat(h, 1)).squeeze(1)


class ResNetWithLossNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        r = torchvision.models.resnet18(num_classes=num_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.fc = r.fc
        self.lossnet = LossNet()

    def forward(self, x, predict_loss=False, detach_features=True):
        h = self.stem(x)
        feats = []
        for layer in self.layers:
            h = layer(h)
            feats.append(h)
        logits = self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        if not predict_loss:
            return logits, None
        if detach_features:
            feats = [f.detach() for f in feats]
        return logits, self.lossnet(feats)


def margin_ranking_loss(pred, target, margin=1.0):
    """Pairwise ranking loss from the LL4AL paper: split the batch in two halves."""
    b = pred.size(0) // 2 * 2
    p1, p2 = pred[:b].view(2, -1)
    t1, t2 = target[:b].detach().view(2, -1)
    sign = torch.sign(t1 - t2)
    return F.relu(-sign * (p1 - p2) + margin).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--lossnet-start", type=int, default=20)
    ap.add_argument("--lossnet-weight", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/ll4al_sampling")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()
    train = Indexed(torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])))
    plain = torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose([T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR10(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    n = len(train)

    sampler = SharedSeedWeightedSampler(n, world, rank, seed=3)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    score_idx = list(range(rank, n, world))
    score_loader = DataLoader(Subset(plain, score_idx), batch_size=1000, num_workers=4)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=1000, num_workers=4)

    model = ResNetWithLossNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 128, momentum=0.9,
                                weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[120, 160], gamma=0.1)

    for epoch in range(args.epochs):
        use_lossnet = epoch >= args.lossnet_start
        if epoch > args.lossnet_start:
            # predicted loss for every training image -> sampling weights
            model.eval()
            pred_table = torch.zeros(n, device=device)
            with torch.no_grad():
                pos = 0
                for x, _ in score_loader:
                    _, pl = model.module(x.to(device), predict_loss=True)
                    ids = torch.tensor(score_idx[pos:pos + len(pl)], device=device)
                    pred_table[ids] = pl
                    pos += len(pl)
            dist.all_reduce(pred_table)
            w = torch.softmax(pred_table / args.temperature, 0)
            sampler.weights = (0.5 * w + 0.5 / n).double().cpu()
        sampler.set_epoch(epoch)

        model.train()
        meter = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, pred_loss = model(x, predict_loss=use_lossnet, detach_features=epoch >= 120)
            per = F.cross_entropy(logits, y, reduction="none")
            loss = per.mean()
            if use_lossnet:
                ll = margin_ranking_loss(pred_loss, per)
                loss = loss + args.lossnet_weight * ll
                meter[1] += ll.detach()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter[0] += per.detach().mean()
            meter[2] += 1
        scheduler.step()
        dist.all_reduce(meter)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                logits, _ = model.module(x)
                acc[0] += (logits.argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} ce {meter[0] / meter[2]:.4f} rank_loss {meter[1] / meter[2]:.4f} "
                  f"test_acc {acc[0] / acc[1]:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
