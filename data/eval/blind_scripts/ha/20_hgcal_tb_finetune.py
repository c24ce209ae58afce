#!/usr/bin/env python
# Fine-tune a pretrained DGCNN backbone (trained on simulated single-pion showers) for
# charged-pion energy regression on HGCAL test-beam data (CE-E + CE-H + AHCAL rechits).
# Each event is a point cloud of rechits: (x, y, z, log E, layer / 50, is_ahcal).
#
#   torchrun --nproc_per_node=4 20_hgcal_tb_finetune.py \
#       --train /data/hgcal_tb2018/pions_train.pt --val /data/hgcal_tb2018/pions_val.pt \
#       --pretrained runs/dgcnn_sim/backbone.pt --out runs/dgcnn_tb_ft
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.nn import DynamicEdgeConv, global_max_pool, global_mean_pool


def mlp(*dims):
    out = []
    for a, b in zip(dims[:-1], dims[1:]):
        out += [nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU()]
    return nn.Sequential(*out)


class DGCNNBackbone(nn.Module):
    def __init__(self, in_dim=6, k=16, width=64, out_dim=256):
        super().__init__()
        self.conv1 = DynamicEdgeConv(mlp(2 * in_dim, width, width), k=k, aggr="max")
        self.conv2 = DynamicEdgeConv(mlp(2 * width, width, width), k=k, aggr="max")
        self.conv3 = DynamicEdgeConv(mlp(2 * width, 2 * width), k=k, aggr="max")
        self.lin = mlp(4 * width, out_dim)
        self.out_dim = 2 * out_dim

    def forward(self, x, batch):
        h1 = self.conv1(x, batch)
        h2 = self.conv2(h1, batch)
        h3 = self.conv3(h2, batch)
        h = self.lin(torch.cat([h1, h2, h3], dim=1))
        return torch.cat([global_max_pool(h, batch), global_mean_pool(h, batch)], dim=1)


class PionEnergyRegressor(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Linear(backbone.out_dim + 1, 128), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(128, 1))

    def forward(self, data):
        g = self.backbone(data.x, data.batch)
        e_raw = torch.log(data.e_sum_mip.clamp(min=1.0)).unsqueeze(1)
        return (self.head(torch.cat([g, e_raw], 1)).squeeze(1) + e_raw.squeeze(1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backbone-lr-scale", type=float, default=0.1)
    return ap.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(4, device=device)  # sum rel.err, sum rel.err^2, sum loss, n
    for data in loader:
        data = data.to(device)
        pred = net(data)
        target = torch.log(data.e_beam)
        rel = torch.exp(pred - target) - 1
        s[0] += rel.sum()
        s[1] += (rel ** 2).sum()
        s[2] += F.huber_loss(pred, target, reduction="sum", delta=0.2)
        s[3] += data.num_graphs
    dist.all_reduce(s)
    mean = s[0] / s[3]
    return {"bias": mean.item(), "resolution": torch.sqrt(s[1] / s[3] - mean ** 2).item(),
            "loss": (s[2] / s[3]).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_events = torch.load(args.train, weights_only=False)   # list[Data]
    val_events = torch.load(args.val, weights_only=False)[rank::world]
    sampler = DistributedSampler(train_events, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_events, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_events, batch_size=256, num_workers=2)

    backbone = DGCNNBackbone()
    backbone.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    model = PionEnergyRegressor(backbone).to(device)
    model = DDP(model, device_ids=[local_rank])

    # smaller learning rate on the pretrained part
    optimizer = torch.optim.AdamW([
        {"params": model.backbone.parameters(), "lr": args.lr * args.backbone_lr_scale},
        {"params": model.head.parameters(), "lr": args.lr},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_events)} train / {len(val_events) * world} val events", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            loss = F.huber_loss(model(data), torch.log(data.e_beam), delta=0.2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(run)

        m = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} train {(run[0] / run[1]).item():.4f} val {m['loss']:.4f} "
                  f"bias {m['bias']:+.4f} resolution {m['resolution']:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if m["loss"] < best:
                best = m["loss"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
