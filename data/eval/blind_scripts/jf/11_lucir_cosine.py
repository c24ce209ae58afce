"""LUCIR (Hou et al., CVPR 2019): cosine classifier, less-forget constraint and
inter-class margin ranking, on ImageNet-Subset (100 classes, 50 + 5x10).

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=node001:29500 11_lucir_cosine.py --data /lustre/imagenet_subset

Each incremental step starts from the checkpoint of the previous step, which
also serves as the frozen reference model.
"""
import argparse
import math
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/lustre/imagenet_subset")
    p.add_argument("--ckpt-dir", default="/lustre/ckpt/lucir_in100")
    p.add_argument("--nb-base", type=int, default=50)
    p.add_argument("--nb-inc", type=int, default=10)
    p.add_argument("--mem-per-class", type=int, default=20)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU (x8 GPUs = 128)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lamda-base", type=float, default=10.0)
    p.add_argument("--dist-margin", type=float, default=0.5)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--start-step", type=int, default=0)
    return p.parse_args()


class CosineLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.sigma = nn.Parameter(torch.tensor(1.0))
        nn.init.uniform_(self.weight, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

    def forward(self, x):
        return self.sigma * F.linear(F.normalize(x, dim=1), F.normalize(self.weight, dim=1))


class LucirNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        r = models.resnet18()
        r.fc = nn.Identity()
        self.features = r
        self.fc = CosineLinear(512, n_classes)

    def forward(self, x):
        f = self.features(x)
        return self.fc(f), f

    @torch.no_grad()
    def expand(self, n_new, new_weights):
        w = torch.cat([self.fc.weight.data, new_weights.to(self.fc.weight)], 0)
        sigma = self.fc.sigma.data.clone()
        self.fc = CosineLinear(w.shape[1], w.shape[0]).to(w.device)
        self.fc.weight.data.copy_(w)
        self.fc.sigma.data.copy_(sigma)


def ckpt_file(d, step):
    return os.path.join(d, f"lucir_step{step}.pth")


def load_checkpoint(path):
    return torch.load(path)


@torch.no_grad()
def imprint(net, ds, classes, device, rank, world):
    """Mean normalised feature of each new class, averaged over all ranks."""
    net.eval()
    sums = torch.zeros(len(classes), 512, device=device)
    cnt = torch.zeros(len(classes), device=device)
    lut = {c: i for i, c in enumerate(classes)}
    shard = Subset(ds, list(range(rank, len(ds), world)))
    for x, y in DataLoader(shard, batch_size=128, num_workers=8):
        f = F.normalize(net(x.to(device))[1], dim=1)
        ids = torch.tensor([lut[int(v)] for v in y], device=device)
        sums.index_add_(0, ids, f)
        cnt.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float))
    dist.all_reduce(sums)
    dist.all_reduce(cnt)
    net.train()
    return F.normalize(sums / cnt[:, None], dim=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1993)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    plain_set = datasets.ImageFolder(os.path.join(args.data, "train"), test_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), test_tf)
    y_tr, y_val = np.array(train_set.targets), np.array(val_set.targets)

    steps = [list(range(args.nb_base))]
    while steps[-1][-1] + 1 < 100:
        lo = steps[-1][-1] + 1
        steps.append(list(range(lo, lo + args.nb_inc)))

    for step in range(args.start_step, len(steps)):
        classes = steps[step]
        n_old, n_known = classes[0], classes[-1] + 1
        net = LucirNet(n_old if step > 0 else n_known).to(device)
        ref = None
        exemplars = []
        if step > 0:
            ckpt = load_checkpoint(ckpt_file(args.ckpt_dir, step - 1))
            net.load_state_dict(ckpt["model"])
            exemplars = ckpt["exemplars"]
            ref = LucirNet(n_old).to(device)
            ref.load_state_dict(net.state_dict())
            ref.eval().requires_grad_(False)
            new_ds = Subset(plain_set, np.where(np.isin(y_tr, classes))[0])
            net.expand(len(classes), imprint(net, new_ds, classes, device, rank, world))

        model = DDP(net, device_ids=[local_rank])
        idx = np.where(np.isin(y_tr, classes))[0].tolist() + exemplars
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        epochs = args.epochs if step == 0 else args.epochs // 3
        lr = args.lr if step == 0 else args.lr / 10
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
        lamda = args.lamda_base * math.sqrt(n_old / len(classes)) if step > 0 else 0.0

        for ep in range(epochs):
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, feats = model(x)
                loss = F.cross_entropy(logits, y)
                if ref is not None:
                    with torch.no_grad():
                        _, ref_feats = ref(x)
                    # less-forget constraint on normalised features
                    loss = loss + lamda * F.cosine_embedding_loss(
                        feats, ref_feats.detach(), torch.ones(x.size(0), device=device))
                    # margin ranking on old-class samples
                    old_mask = y < n_old
                    if old_mask.any():
                        cos = logits[old_mask] / net.fc.sigma
                        gt = cos.gather(1, y[old_mask, None]).repeat(1, args.K)
                        hard = cos[:, n_old:].topk(args.K, dim=1)[0]
                        loss = loss + F.margin_ranking_loss(
                            gt.view(-1), hard.view(-1), torch.ones_like(gt.view(-1)), margin=args.dist_margin)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and ep % 10 == 0:
                print(f"step {step} ep {ep} loss {loss.item():.4f}", flush=True)

        # exemplars: first m samples of each class in a fixed shuffled order (identical on all ranks)
        rng = np.random.RandomState(step)
        for c in classes:
            exemplars += rng.permutation(np.where(y_tr == c)[0])[:args.mem_per_class].tolist()

        # CNN accuracy on all seen classes
        net.eval()
        vidx = np.where(y_val < n_known)[0][rank::world]
        stat = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in DataLoader(Subset(val_set, vidx), batch_size=128, num_workers=8):
                out, _ = net(x.to(device))
                stat[0] += (out.argmax(1).cpu() == y).sum().item()
                stat[1] += len(y)
        dist.all_reduce(stat)
        if rank == 0:
            print(f"==> step {step}: {n_known} classes, top-1 {100 * stat[0] / stat[1]:.2f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "exemplars": exemplars, "step": step},
                       ckpt_file(args.ckpt_dir, step))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
