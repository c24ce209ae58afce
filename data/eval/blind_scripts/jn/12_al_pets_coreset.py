"""Core-set active learning on Oxford-IIIT Pets (37 breeds), ResNet-34 fine-tuned per round.

    torchrun --standalone --nproc_per_node=4 12_al_pets_coreset.py --root /datasets --out /shared/al/pets_coreset
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

log = logging.getLogger("pets-al")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets")
    p.add_argument("--out", required=True)
    p.add_argument("--init", type=int, default=370)
    p.add_argument("--query", type=int, default=185)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=32, help="per-GPU batch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class PetNet(nn.Module):
    def __init__(self, n_classes=37):
        super().__init__()
        backbone = torchvision.models.resnet34(weights=torchvision.models.ResNet34_Weights.DEFAULT)
        self.dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.head = nn.Linear(self.dim, n_classes)

    def embed(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.head(self.embed(x))


class Indexed(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


@torch.no_grad()
def extract_embeddings(model, ds, idx, device):
    sub = Subset(Indexed(ds), idx.tolist())
    loader = DataLoader(sub, batch_size=128, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=6, pin_memory=True)
    model.eval()
    feats, ids = [], []
    for x, _, i in loader:
        feats.append(model.embed(x.to(device, non_blocking=True)).float())
        ids.append(i.to(device))
    feats, ids = torch.cat(feats), torch.cat(ids)
    world = dist.get_world_size()
    all_f = [torch.empty_like(feats) for _ in range(world)]
    all_i = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(all_f, feats)
    dist.all_gather(all_i, ids)
    feats, ids = torch.cat(all_f), torch.cat(all_i)
    uniq, first = np.unique(ids.cpu().numpy(), return_index=True)
    return feats[torch.as_tensor(first, device=device)], uniq


def greedy_k_center(unl_feats, lab_feats, k):
    min_dist = torch.cdist(unl_feats, lab_feats).min(dim=1).values
    picks = []
    for _ in range(k):
        i = int(torch.argmax(min_dist))
        picks.append(i)
        min_dist = torch.minimum(min_dist, torch.cdist(unl_feats, unl_feats[i:i + 1])[:, 0])
    return picks


@torch.no_grad()
def evaluate(net, ds, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    part = list(range(rank, len(ds), world))
    loader = DataLoader(Subset(ds, part), batch_size=128, num_workers=6)
    net.eval()
    correct = total = 0
    for x, y in loader:
        pred = net(x.to(device, non_blocking=True)).argmax(1).cpu()
        correct += (pred == y).sum().item()
        total += len(y)
    t = torch.tensor([correct, total], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf_train = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), norm])
    tf_eval = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = torchvision.datasets.OxfordIIITPet(args.root, split="trainval", transform=tf_train)
    pool_ds = torchvision.datasets.OxfordIIITPet(args.root, split="trainval", transform=tf_eval)
    test_ds = torchvision.datasets.OxfordIIITPet(args.root, split="test", transform=tf_eval)

    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(len(train_ds), args.init, replace=False))
    all_idx = np.arange(len(train_ds))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    lr = args.lr * args.bs * world / 128
    history = []
    for rnd in range(args.rounds):
        t0 = time.time()
        model = PetNet().to(device)
        model = DDP(model, device_ids=[local_rank])
        backbone_params = list(model.module.backbone.parameters())
        opt = torch.optim.SGD([{"params": backbone_params, "lr": lr},
                               {"params": model.module.head.parameters(), "lr": lr * 10}],
                              momentum=0.9, weight_decay=1e-4)
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=args.bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()

        acc = evaluate(model.module, test_ds, device)

        unlabelled = np.setdiff1d(all_idx, labelled)
        unl_f, unl_ids = extract_embeddings(model, pool_ds, unlabelled, device)
        lab_f, _ = extract_embeddings(model, pool_ds, labelled, device)
        chosen = torch.zeros(args.query, dtype=torch.long, device=device)
        if rank == 0:
            picks = greedy_k_center(unl_f, lab_f, args.query)
            chosen.copy_(torch.as_tensor(unl_ids[picks], device=device))
        dist.broadcast(chosen, src=0)
        labelled = np.union1d(labelled, chosen.cpu().numpy())

        history.append({"round": rnd, "labelled": len(sub), "test_acc": acc, "sec": time.time() - t0})
        log.info("round %d: %s", rnd, history[-1])
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "labelled": labelled.tolist(), "round": rnd},
                       os.path.join(args.out, "latest.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
