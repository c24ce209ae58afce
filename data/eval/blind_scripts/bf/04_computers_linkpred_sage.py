"""Link prediction on Amazon-Computers with GraphSAGE + dot-product decoder.

Positive training edges are sharded across ranks and fed through
LinkNeighborLoader, which samples one negative per positive on the fly.

    torchrun --standalone --nproc_per_node=2 04_computers_linkpred_sage.py
"""
import argparse
import os
import os.path as osp
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import Amazon
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=osp.expanduser("~/data/Amazon"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--num_neighbors", type=int, nargs="+", default=[15, 10])
    parser.add_argument("--batch_size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--val_ratio", type=float, default=0.05)
    parser.add_argument("--test_ratio", type=float, default=0.10)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ckpt", default="checkpoints/computers_linkpred.pt")
    return parser.parse_args()


class Encoder(torch.nn.Module):
    def __init__(self, in_channels, hidden, out):
        super().__init__()
        self.conv1 = SAGEConv(in_channels, hidden)
        self.conv2 = SAGEConv(hidden, out)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=0.3, training=self.training)
        return self.conv2(x, edge_index)


class LinkPredictor(torch.nn.Module):
    def __init__(self, in_channels, hidden, out):
        super().__init__()
        self.encoder = Encoder(in_channels, hidden, out)

    def forward(self, x, edge_index, edge_label_index):
        z = self.encoder(x, edge_index)
        src, dst = edge_label_index
        return (z[src] * z[dst]).sum(dim=-1)


@torch.no_grad()
def evaluate(model, data, device):
    model.eval()
    data = data.to(device)
    logits = model(data.x, data.edge_index, data.edge_label_index)
    y = data.edge_label.cpu().numpy()
    p = logits.sigmoid().cpu().numpy()
    return roc_auc_score(y, p), average_precision_score(y, p)


def main():
    args = get_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different dropout masks / negative samples on every rank
    torch.manual_seed(args.seed + rank)

    if rank == 0:
        Amazon(args.root, name="Computers")
    dist.barrier()
    dataset = Amazon(args.root, name="Computers", transform=T.NormalizeFeatures())
    data = dataset[0]

    split = T.RandomLinkSplit(
        num_val=args.val_ratio,
        num_test=args.test_ratio,
        is_undirected=True,
        add_negative_train_samples=False,
    )
    train_data, val_data, test_data = split(data)

    # shard the supervision edges; the message-passing graph stays whole
    num_train = train_data.edge_label_index.size(1)
    perm = torch.randperm(num_train, generator=torch.Generator().manual_seed(args.seed))
    per_rank = num_train // world_size
    shard = perm[rank * per_rank:(rank + 1) * per_rank]

    train_loader = LinkNeighborLoader(
        train_data,
        num_neighbors=args.num_neighbors,
        edge_label_index=train_data.edge_label_index[:, shard],
        edge_label=train_data.edge_label[shard],
        neg_sampling_ratio=1.0,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
    )

    model = LinkPredictor(dataset.num_features, args.hidden, args.out).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_val_auc = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        start = time.perf_counter()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach() * batch.edge_label.numel()
            loss_sum[1] += batch.edge_label.numel()
        dist.all_reduce(loss_sum)

        if rank == 0:
            val_auc, val_ap = evaluate(model.module, val_data, device)
            print(f"epoch {epoch:03d}  loss {(loss_sum[0] / loss_sum[1]).item():.4f}  "
                  f"val auc {val_auc:.4f} ap {val_ap:.4f}  "
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
            if val_auc > best_val_auc:
                best_val_auc = val_auc
                os.makedirs(osp.dirname(args.ckpt), exist_ok=True)
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "val_auc": val_auc}, args.ckpt)
        dist.barrier()

    if rank == 0:
        state = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(state["state_dict"])
        test_auc, test_ap = evaluate(model.module, test_data, device)
        print(f"best epoch {state['epoch']}: val auc {state['val_auc']:.4f} | "
              f"test auc {test_auc:.4f} ap {test_ap:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
