"""
ProtoNet + ResNet-12 on tieredImageNet: meta-training, then a final meta-test
of the best checkpoint on 1-shot and 5-shot episodes (mean +- 95% CI).

    torchrun --nproc_per_node=8 14_protonet_res12_test.py --config configs/tiered_protonet.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from fewshot.data import TieredImageNet, EpisodicBatchSampler
from fewshot.models.resnet12 import resnet12
from fewshot.utils import AverageMeter, set_seed


class ProtoNet(nn.Module):
    def __init__(self, backbone, metric="euclidean"):
        super().__init__()
        self.backbone = backbone
        self.metric = metric

    def forward(self, images, way, shot):
        feats = self.backbone(images)
        n_s = way * shot
        protos = feats[:n_s].view(shot, way, -1).mean(0)
        q = feats[n_s:]
        if self.metric == "cosine":
            return F.normalize(q, dim=-1) @ F.normalize(protos, dim=-1).t() * 10.0
        return -torch.cdist(q, protos).pow(2) / feats.size(1)


def make_loader(dataset, episodes, way, shot, query, seed, workers):
    sampler = EpisodicBatchSampler(dataset.labels, episodes, way, shot + query, seed=seed)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=True)


@torch.no_grad()
def meta_test(model, loader, way, shot, query, device):
    model.eval()
    y = torch.arange(way, device=device).repeat(query)
    accs = []
    for x, _ in loader:
        accs.append((model(x.to(device, non_blocking=True), way, shot).argmax(1) == y).float().mean())
    model.train()
    accs = torch.stack(accs)
    bucket = [torch.empty_like(accs) for _ in range(dist.get_world_size())]
    dist.all_gather(bucket, accs)
    accs = torch.cat(bucket).double()
    return accs.mean().item(), (1.96 * accs.std() / accs.numel() ** 0.5).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(cfg.get("seed", 0))

    root, workers = cfg["data_root"], cfg.get("workers", 8)
    way, shot, query = cfg["train_way"], cfg["shot"], cfg["query"]
    train_loader = make_loader(TieredImageNet(root, "train", augment=True), cfg["episodes_per_epoch"],
                               way, shot, query, seed=cfg.get("seed", 0) * 7919 + rank, workers=workers)
    val_set = TieredImageNet(root, "val", augment=False)
    val_loader = make_loader(val_set, cfg["val_episodes"] // world, 5, shot, 15, seed=3 + rank,
                             workers=workers)

    model = ProtoNet(resnet12(drop_rate=0.1, dropblock_size=5), cfg.get("metric", "euclidean"))
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, nesterov=True,
                                weight_decay=cfg.get("weight_decay", 5e-4))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg["epochs"])

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    y_train = torch.arange(way, device=device).repeat(query)
    best_acc = 0.0
    for epoch in range(1, cfg["epochs"] + 1):
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        t0 = time.time()
        for x, _ in train_loader:
            logits = model(x.to(device, non_blocking=True), way, shot)
            loss = F.cross_entropy(logits, y_train)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter.update(loss.item())
            acc_meter.update((logits.argmax(1) == y_train).float().mean().item())
        scheduler.step()
        stats = torch.tensor([loss_meter.avg, acc_meter.avg], device=device)
        dist.all_reduce(stats)
        stats /= world

        val_acc, val_ci = meta_test(model, val_loader, 5, shot, 15, device)
        if rank == 0:
            print(f"ep {epoch:3d} | loss {stats[0]:.3f} acc {stats[1]:.3f} | "
                  f"val {100 * val_acc:.2f} +- {100 * val_ci:.2f} | {time.time() - t0:.0f}s", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.state_dict(), os.path.join(out_dir, "best.pth"))
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, "last.pth"))
        dist.barrier()

    # final meta-test with a fresh model built from the best checkpoint
    test_set = TieredImageNet(root, "test", augment=False)
    test_model = ProtoNet(resnet12(drop_rate=0.1, dropblock_size=5), cfg.get("metric", "euclidean"))
    test_model.load_state_dict(torch.load(os.path.join(out_dir, "best.pth"), map_location="cpu"))
    test_model.to(device)
    results = {}
    for test_shot in (1, 5):
        loader = make_loader(test_set, cfg.get("test_episodes", 2000) // world, 5, test_shot, 15,
                             seed=100 + test_shot * 10 + rank, workers=workers)
        results[test_shot] = meta_test(test_model, loader, 5, test_shot, 15, device)
    if rank == 0:
        for s, (acc, ci) in results.items():
            print(f"tieredImageNet test 5-way {s}-shot: {100 * acc:.2f} +- {100 * ci:.2f}")
        with open(os.path.join(out_dir, "test_results.yaml"), "w") as f:
            yaml.safe_dump({f"{s}shot": {"acc": float(a), "ci95": float(c)}
                            for s, (a, c) in results.items()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
