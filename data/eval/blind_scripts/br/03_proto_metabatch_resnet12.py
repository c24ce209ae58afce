"""ProtoNet with a ResNet-12 backbone and a meta-batch of episodes per update.

One update averages the loss of `meta_batch` episodes; the episodes of a
meta-batch are divided between the GPUs.

    torchrun --nproc_per_node=4 03_proto_metabatch_resnet12.py --config configs/mini_5w5s.yaml
"""
import argparse
import logging
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

from datasets.mini_imagenet import MiniImageNet
from datasets.samplers import CategoriesSampler

log = logging.getLogger("proto")

DEFAULTS = dict(
    data_root="/datasets/miniImageNet", out_dir="runs/proto_r12",
    way=5, shot=5, query=15, meta_batch=10, max_epoch=100, episodes_per_epoch=200,
    lr=0.1, momentum=0.9, weight_decay=5e-4, milestones=[40, 70], temperature=64.0,
    val_episodes=500, num_workers=8, seed=0,
)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, drop=0.1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv3 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.pool = nn.MaxPool2d(2)
        self.drop = drop

    def forward(self, x):
        out = F.leaky_relu(self.bn1(self.conv1(x)), 0.1)
        out = F.leaky_relu(self.bn2(self.conv2(out)), 0.1)
        out = self.bn3(self.conv3(out))
        out = self.pool(F.leaky_relu(out + self.shortcut(x), 0.1))
        return F.dropout(out, self.drop, self.training)


class ResNet12(nn.Module):
    def __init__(self, channels=(64, 160, 320, 640)):
        super().__init__()
        layers, cin = [], 3
        for c in channels:
            layers.append(BasicBlock(cin, c))
            cin = c
        self.layers = nn.Sequential(*layers)
        self.out_dim = cin

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.layers(x), 1).flatten(1)


def episode_loss(model, images, way, shot, query, temperature):
    emb = model(images)
    n_s = way * shot
    protos = emb[:n_s].view(shot, way, -1).mean(0)
    logits = -torch.cdist(emb[n_s:], protos).pow(2) / temperature
    labels = torch.arange(way, device=images.device).repeat(query)
    return F.cross_entropy(logits, labels), (logits.argmax(1) == labels).float().mean()


@torch.no_grad()
def validate(model, loader, cfg, device):
    model.eval()
    accs = []
    for images, _ in loader:
        _, acc = episode_loss(model, images.to(device, non_blocking=True),
                              cfg["way"], cfg["shot"], cfg["query"], cfg["temperature"])
        accs.append(acc)
    model.train()
    local = torch.stack(accs)
    everything = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everything, local)
    allacc = torch.cat(everything).cpu().numpy()
    return allacc.mean(), 1.96 * allacc.std() / np.sqrt(len(allacc))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--override", nargs="*", default=[], help="key=value")
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in args.override:
        k, v = kv.split("=", 1)
        cfg[k] = yaml.safe_load(v)

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    trainset = MiniImageNet("train", cfg["data_root"], augment=True)
    valset = MiniImageNet("val", cfg["data_root"], augment=False)
    n_per_class = cfg["shot"] + cfg["query"]
    # each rank gets its own stream of episodes; one loader item = one episode
    train_sampler = CategoriesSampler(trainset.label, cfg["episodes_per_epoch"] * cfg["meta_batch"],
                                      cfg["way"], n_per_class, seed=cfg["seed"] + 1000 * rank)
    train_loader = DataLoader(trainset, batch_sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True)
    val_sampler = CategoriesSampler(valset.label, cfg["val_episodes"] // world, cfg["way"],
                                    n_per_class, seed=12345 + rank)
    val_loader = DataLoader(valset, batch_sampler=val_sampler,
                            num_workers=cfg["num_workers"], pin_memory=True)

    model = ResNet12().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.get("sync_bn") else model
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                                nesterov=True, weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["milestones"], gamma=0.1)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    best = 0.0
    for epoch in range(1, cfg["max_epoch"] + 1):
        t0 = time.time()
        episodes = iter(train_loader)
        running = torch.zeros(2, device=device)
        for step in range(cfg["episodes_per_epoch"]):
            optimizer.zero_grad(set_to_none=True)
            # this rank's share of the meta-batch
            for task in range(rank, cfg["meta_batch"], world):
                images, _ = next(episodes)
                loss, acc = episode_loss(model, images.to(device, non_blocking=True),
                                         cfg["way"], cfg["shot"], cfg["query"], cfg["temperature"])
                (loss / cfg["meta_batch"] * world).backward()
                running += torch.stack([loss.detach(), acc])
            optimizer.step()
        scheduler.step()

        dist.all_reduce(running)
        running /= cfg["episodes_per_epoch"] * cfg["meta_batch"]
        val_acc, val_ci = validate(model, val_loader, cfg, device)
        log.info("epoch %d  loss %.4f  acc %.4f  val %.2f+-%.2f  lr %.4g  %.0fs", epoch,
                 running[0].item(), running[1].item(), 100 * val_acc, 100 * val_ci,
                 scheduler.get_last_lr()[0], time.time() - t0)

        if rank == 0:
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "cfg": cfg, "val_acc": val_acc}
            torch.save(ckpt, os.path.join(cfg["out_dir"], "last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(ckpt, os.path.join(cfg["out_dir"], "max_acc.pth"))
        dist.barrier()

    log.info("best val acc %.2f", 100 * best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
