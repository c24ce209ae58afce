# Recurrent interaction GNN for ITk edge classification (GNN4ITk-like stage 2).
# Input: PyG Data objects written by the metric-learning graph construction stage,
# one file per event under <input_dir>/{trainset,valset}/.
# Graphs are big (~300k nodes, ~2M edges at pT > 1 GeV), so the message-passing
# iterations are checkpointed to fit on the A100s.
#
#   torchrun --nproc_per_node=4 08_itk_recurrent_ign.py --input_dir /global/cfs/itk/gnn_input \
#       --output_dir /global/cfs/itk/gnn_runs/rig_h128 --hidden 128 --n_iters 8
import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Dataset
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

NODE_FEATURES = ["r", "phi", "z", "eta", "cluster_r_1", "cluster_z_1", "cluster_r_2", "cluster_z_2"]
FEATURE_SCALES = [1000.0, 3.14, 1000.0, 1.0, 1000.0, 1000.0, 1000.0, 1000.0]


def make_mlp(d_in, hidden, d_out, n_layers=2, out_act=True):
    dims = [d_in] + [hidden] * (n_layers - 1) + [d_out]
    mods = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or out_act:
            mods += [nn.LayerNorm(dims[i + 1]), nn.ReLU()]
    return nn.Sequential(*mods)


class RecurrentIGNN(nn.Module):
    def __init__(self, n_feat, hidden=128, n_iters=8, checkpointing=True):
        super().__init__()
        self.n_iters = n_iters
        self.checkpointing = checkpointing
        self.node_encoder = make_mlp(n_feat, hidden, hidden)
        self.edge_encoder = make_mlp(2 * hidden, hidden, hidden)
        self.edge_network = make_mlp(3 * hidden, hidden, hidden)
        self.node_network = make_mlp(3 * hidden, hidden, hidden)
        self.output_network = make_mlp(3 * hidden, hidden, 1, n_layers=3, out_act=False)

    def message_step(self, x, e, src, dst):
        n = x.shape[0]
        e_new = self.edge_network(torch.cat([x[src], x[dst], e], dim=-1))
        m_in = scatter(e_new, dst, dim=0, dim_size=n, reduce="sum")
        m_out = scatter(e_new, src, dim=0, dim_size=n, reduce="sum")
        x_new = self.node_network(torch.cat([x, m_in, m_out], dim=-1))
        return x + x_new, e + e_new

    def forward(self, x, edge_index):
        src, dst = edge_index
        x = self.node_encoder(x)
        e = self.edge_encoder(torch.cat([x[src], x[dst]], dim=-1))
        for _ in range(self.n_iters):
            if self.checkpointing and self.training:
                x, e = checkpoint(self.message_step, x, e, src, dst)
            else:
                x, e = self.message_step(x, e, src, dst)
        return self.output_network(torch.cat([x[src], x[dst], e], dim=-1)).squeeze(-1)


class EventGraphs(Dataset):
    def __init__(self, folder, max_events=None):
        super().__init__()
        self.paths = sorted(Path(folder).glob("*.pyg"))[:max_events]
        self.scales = torch.tensor(FEATURE_SCALES)

    def len(self):
        return len(self.paths)

    def get(self, idx):
        g = torch.load(self.paths[idx], weights_only=False)
        g.x = torch.stack([g[f] for f in NODE_FEATURES], dim=-1).float() / self.scales
        # y: edge connects consecutive hits of the same particle
        g.y = g.y.float()
        return g


def build_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--n_iters", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--pos_weight", type=float, default=2.0)
    ap.add_argument("--n_train", type=int, default=7800)
    ap.add_argument("--n_val", type=int, default=200)
    ap.add_argument("--no_checkpointing", action="store_true")
    return ap.parse_args()


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    c = torch.zeros(4, device=device, dtype=torch.float64)  # tp, pred_pos, true_pos, loss*n
    for g in loader:
        g = g.to(device)
        logits = net(g.x, g.edge_index)
        pred = logits.sigmoid() > 0.5
        truth = g.y.bool()
        c[0] += (pred & truth).sum()
        c[1] += pred.sum()
        c[2] += truth.sum()
        c[3] += F.binary_cross_entropy_with_logits(logits, g.y, reduction="sum").double() / g.y.numel()
    dist.all_reduce(c)
    return {"eff": (c[0] / c[2]).item(), "pur": (c[0] / c[1].clamp(min=1)).item(), "loss_sum": c[3].item()}


def main():
    args = build_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = EventGraphs(os.path.join(args.input_dir, "trainset"), args.n_train)
    val_set = EventGraphs(os.path.join(args.input_dir, "valset"), args.n_val)
    val_set = val_set.index_select(list(range(rank, len(val_set), world)))
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=2)

    model = RecurrentIGNN(len(NODE_FEATURES), args.hidden, args.n_iters,
                          checkpointing=not args.no_checkpointing).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{len(train_set)} train events, {args.n_val} val events, world size {world}", flush=True)

    best_loss, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for g in train_loader:
            g = g.to(device, non_blocking=True)
            logits = model(g.x, g.edge_index)
            loss = F.binary_cross_entropy_with_logits(logits, g.y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones_like(loss)])
        scheduler.step()
        dist.all_reduce(acc)

        m = validate(model.module, val_loader, device)
        val_loss = m["loss_sum"] / args.n_val
        if rank == 0:
            print(f"epoch {epoch} train {(acc[0] / acc[1]).item():.5f} val {val_loss:.5f} "
                  f"eff {m['eff']:.4f} pur {m['pur']:.4f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "hparams": vars(args)},
                       out / "last.ckpt")
        if val_loss < best_loss:
            best_loss, bad_epochs = val_loss, 0
            if rank == 0:
                torch.save(model.module.state_dict(), out / "best_weights.pt")
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stop at epoch {epoch}")
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
