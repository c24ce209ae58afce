"""DGL GraphSAGE on Reddit, multi-GPU with early stopping on validation accuracy.

torchrun --standalone --nproc_per_node=4 06_dgl_reddit_earlystop.py --patience 5
"""
import argparse
import os
import time

import dgl
import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from dgl.data import RedditDataset
from dgl.dataloading import DataLoader, NeighborSampler
from torch.nn.parallel import DistributedDataParallel as DDP


class SAGE(nn.Module):
    def __init__(self, in_feats, n_hidden, n_classes, n_layers, dropout, aggr="mean"):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_feats, n_hidden, aggr))
        for _ in range(n_layers - 2):
            self.layers.append(dglnn.SAGEConv(n_hidden, n_hidden, aggr))
        self.layers.append(dglnn.SAGEConv(n_hidden, n_classes, aggr))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
                h = self.dropout(h)
        return h


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw_dir", default="/data/dgl")
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--num_hidden", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--fan_out", default="25,10")
    p.add_argument("--batch_size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--save_path", default="checkpoints/sage_reddit_best.pt")
    p.add_argument("--wandb_project", default="gnn-reddit")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for _, _, blocks in loader:
        logits = model(blocks, blocks[0].srcdata["feat"])
        labels = blocks[-1].dstdata["label"]
        stats[0] += (logits.argmax(1) == labels).sum()
        stats[1] += labels.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        RedditDataset(raw_dir=args.raw_dir, self_loop=True)
    dist.barrier()
    g = RedditDataset(raw_dir=args.raw_dir, self_loop=True, verbose=False)[0]
    g.create_formats_()
    n_classes = int(g.ndata["label"].max()) + 1
    train_nid = torch.nonzero(g.ndata["train_mask"], as_tuple=True)[0].to(device)
    val_nid = torch.nonzero(g.ndata["val_mask"], as_tuple=True)[0].to(device)
    test_nid = torch.nonzero(g.ndata["test_mask"], as_tuple=True)[0].to(device)

    sampler = NeighborSampler(
        [int(f) for f in args.fan_out.split(",")],
        prefetch_node_feats=["feat"], prefetch_labels=["label"],
    )
    common = dict(device=device, use_ddp=True, use_uva=True, num_workers=0)
    train_loader = DataLoader(g, train_nid, sampler, batch_size=args.batch_size,
                              shuffle=True, drop_last=False, **common)
    val_loader = DataLoader(g, val_nid, sampler, batch_size=4096,
                            shuffle=False, drop_last=False, **common)
    test_loader = DataLoader(g, test_nid, sampler, batch_size=4096,
                             shuffle=False, drop_last=False, **common)

    model = SAGE(g.ndata["feat"].shape[1], args.num_hidden, n_classes,
                 args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args))
        os.makedirs(os.path.dirname(args.save_path), exist_ok=True)

    best_val, bad_epochs = 0.0, 0
    for epoch in range(args.num_epochs):
        model.train()
        tic = time.time()
        loss_sum = torch.zeros((), device=device)
        n_steps = 0
        for step, (_, _, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            n_steps += 1
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (n_steps * dist.get_world_size())

        val_acc = evaluate(model.module, val_loader, device)

        if rank == 0:
            wandb.log({"epoch": epoch, "train_loss": train_loss, "val_acc": val_acc,
                       "epoch_time": time.time() - tic})
            print(f"Epoch {epoch:03d} | loss {train_loss:.4f} | val {val_acc:.4f}", flush=True)
            if val_acc > best_val:
                best_val, bad_epochs = val_acc, 0
                torch.save(model.module.state_dict(), args.save_path)
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    print(f"early stopping at epoch {epoch}", flush=True)
                    break

    dist.barrier()
    model.module.load_state_dict(torch.load(args.save_path, map_location=device))
    test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best val {best_val:.4f} | test {test_acc:.4f}")
        wandb.log({"test_acc": test_acc})
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
