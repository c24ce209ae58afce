"""E(n)-GNN (invariant variant, no coordinate updates) for the QM9 HOMO-LUMO gap.

    torchrun --standalone --nproc_per_node=4 17_qm9_egnn_gap.py --root /data/QM9 --epochs 1000
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_scatter import scatter

GAP_COL = 4
ELEMENTS = {1: 0, 6: 1, 7: 2, 8: 3, 9: 4}


class EGNNLayer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU())
        self.att = nn.Sequential(nn.Linear(hidden, 1), nn.Sigmoid())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, d2):
        src, dst = edge_index
        m = self.edge_mlp(torch.cat([h[dst], h[src], d2], dim=-1))
        m = m * self.att(m)
        agg = scatter(m, dst, dim=0, dim_size=h.size(0), reduce="sum")
        return h + self.node_mlp(torch.cat([h, agg], dim=-1))


class EGNN(nn.Module):
    def __init__(self, hidden=128, layers=7, cutoff=5.0):
        super().__init__()
        self.cutoff = cutoff
        self.embed = nn.Linear(len(ELEMENTS) + 1, hidden)  # one-hot element + charge/9
        self.layers = nn.ModuleList(EGNNLayer(hidden) for _ in range(layers))
        self.node_dec = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.graph_dec = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        lut = torch.full((10,), -1, dtype=torch.long)
        for z, k in ELEMENTS.items():
            lut[z] = k
        self.register_buffer("lut", lut)

    def forward(self, z, pos, batch):
        onehot = nn.functional.one_hot(self.lut[z], len(ELEMENTS)).float()
        h = self.embed(torch.cat([onehot, (z.float() / 9.0).unsqueeze(-1)], dim=-1))
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        d2 = (pos[edge_index[0]] - pos[edge_index[1]]).pow(2).sum(-1, keepdim=True)
        for layer in self.layers:
            h = layer(h, edge_index, d2)
        h = scatter(self.node_dec(h), batch, dim=0, reduce="sum")
        return self.graph_dec(h).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, mad, meann):
    model.eval()
    abs_err, n = 0.0, 0
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch) * mad + meann
        abs_err += (pred - data.y[:, GAP_COL]).abs().sum().item()
        n += data.num_graphs
    return abs_err / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/QM9")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=1e-16)
    ap.add_argument("--exp_dir", default="exp/egnn_gap")
    ap.add_argument("--test_interval", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        QM9(args.root)
        os.makedirs(args.exp_dir, exist_ok=True)
    dist.barrier()
    ds = QM9(args.root)

    # Cormorant/EGNN split sizes: 100k train, ~18k val, ~13k test
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()
    train_set, val_set, test_set = Subset(ds, perm[:100000]), Subset(ds, perm[100000:117748]), Subset(ds, perm[117748:])

    y = ds.y[perm[:100000], GAP_COL]
    meann = y.mean().item()
    mad = (y - meann).abs().mean().item()

    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler, num_workers=2)

    model = DDP(EGNN().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.7, patience=20, min_lr=1e-6)

    history = []
    best_val, best_test, best_epoch = float("inf"), float("inf"), -1
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum, count = 0.0, 0
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = model(data.z, data.pos, data.batch)
            loss = nn.functional.l1_loss(pred, (data.y[:, GAP_COL] - meann) / mad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * data.num_graphs
            count += data.num_graphs

        if epoch % args.test_interval == 0:
            val_mae = evaluate(model, val_loader, device, mad, meann)
            test_mae = evaluate(model, test_loader, device, mad, meann)
            sched.step(val_mae)
            if val_mae < best_val:
                best_val, best_test, best_epoch = val_mae, test_mae, epoch
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "meann": meann, "mad": mad},
                               os.path.join(args.exp_dir, "best.pt"))
            if rank == 0:
                history.append({"epoch": epoch, "train_l1": loss_sum / count, "val_mae": val_mae, "test_mae": test_mae})
                print(f"epoch {epoch}: train {loss_sum / count:.4f} | val {val_mae * 1000:.1f} meV | "
                      f"test {test_mae * 1000:.1f} meV | best val {best_val * 1000:.1f} (test {best_test * 1000:.1f}, "
                      f"epoch {best_epoch}) | lr {opt.param_groups[0]['lr']:.1e} | {time.time() - t0:.0f}s", flush=True)
                with open(os.path.join(args.exp_dir, "history.json"), "w") as f:
                    json.dump(history, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
