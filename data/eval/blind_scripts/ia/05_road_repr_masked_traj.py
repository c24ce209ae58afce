"""Self-supervised road-segment representations from map-matched trajectories.

A GAT encodes the road network (segment features: length, lanes, maxspeed,
highway type one-hot, betweenness); trajectories over the segment graph are
encoded by a transformer and trained with masked-segment prediction. Every few
epochs the segment embeddings are probed on road-type classification.

    torchrun --nproc_per_node=8 05_road_repr_masked_traj.py --city xian
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import GATv2Conv


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--city", default="xian")
    p.add_argument("--root", default="/datasets/didi_gaia")
    p.add_argument("--out", default="outputs/road_repr")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--gat_heads", type=int, default=4)
    p.add_argument("--gat_layers", type=int, default=2)
    p.add_argument("--tf_layers", type=int, default=4)
    p.add_argument("--max_len", type=int, default=96)
    p.add_argument("--mask_prob", type=float, default=0.15)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--probe_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class MaskedTrajDataset(Dataset):
    """Fixed-length windows of segment ids; masking is done on the GPU."""

    def __init__(self, paths, max_len, pad_id):
        self.paths, self.max_len, self.pad_id = paths, max_len, pad_id

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i]
        if len(p) > self.max_len:
            s = np.random.randint(0, len(p) - self.max_len + 1)
            p = p[s: s + self.max_len]
        out = np.full(self.max_len, self.pad_id, dtype=np.int64)
        out[: len(p)] = p
        return torch.from_numpy(out)


class RoadTrajEncoder(nn.Module):
    def __init__(self, n_seg, feat_dim, dim, heads, gat_layers, tf_layers, max_len):
        super().__init__()
        self.n_seg = n_seg
        self.proj = nn.Linear(feat_dim, dim)
        self.id_emb = nn.Embedding(n_seg, dim)
        self.gats = nn.ModuleList([GATv2Conv(dim, dim // heads, heads=heads) for _ in range(gat_layers)])
        self.special = nn.Embedding(2, dim)  # 0: [MASK], 1: [PAD]
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, batch_first=True, activation="gelu")
        self.tf = nn.TransformerEncoder(layer, tf_layers)
        self.lm_head = nn.Linear(dim, n_seg)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def encode_roads(self, x, edge_index):
        h = self.proj(x) + self.id_emb.weight
        for conv in self.gats:
            h = h + F.elu(conv(h, edge_index))
        return h

    def forward(self, x, edge_index, seg_ids, mask):
        road = self.encode_roads(x, edge_index)
        table = torch.cat([road, self.special.weight], 0)  # ids n_seg / n_seg + 1 = MASK / PAD
        inp = torch.where(mask, torch.full_like(seg_ids, self.n_seg), seg_ids)
        h = table[inp] + self.pos[:, : seg_ids.size(1)]
        h = self.tf(h, src_key_padding_mask=seg_ids.eq(self.n_seg + 1))
        return self.lm_head(h)


def random_mask(seg_ids, pad_id, prob):
    valid = seg_ids.ne(pad_id)
    m = (torch.rand(seg_ids.shape, device=seg_ids.device) < prob) & valid
    m[:, 0] |= ~m.any(1) & valid[:, 0]
    return m


def probe_road_type(emb, labels, seed):
    keep = labels >= 0
    xtr, xte, ytr, yte = train_test_split(emb[keep], labels[keep], test_size=0.3,
                                          random_state=seed, stratify=labels[keep])
    clf = LogisticRegression(max_iter=2000, n_jobs=8).fit(xtr, ytr)
    pred = clf.predict(xte)
    return f1_score(yte, pred, average="micro"), f1_score(yte, pred, average="macro")


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    city_dir = os.path.join(args.root, args.city)
    graph = torch.load(os.path.join(city_dir, "road_graph.pt"), map_location="cpu", weights_only=False)
    road_type = np.load(os.path.join(city_dir, "road_type_labels.npy"))
    paths = np.load(os.path.join(city_dir, "mm_paths.npy"), allow_pickle=True)
    n_seg = graph.num_nodes
    pad_id = n_seg + 1
    x, edge_index = graph.x.float().to(device), graph.edge_index.to(device)

    ds = MaskedTrajDataset(paths, args.max_len, pad_id)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = RoadTrajEncoder(n_seg, x.size(1), args.dim, args.gat_heads, args.gat_layers,
                            args.tf_layers, args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total, pct_start=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{args.city}: segments={n_seg} edges={edge_index.size(1)} trajectories={len(ds)}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for step, seg_ids in enumerate(loader):
            seg_ids = seg_ids.to(device, non_blocking=True)
            mask = random_mask(seg_ids, pad_id, args.mask_prob)
            logits = model(x, edge_index, seg_ids, mask)
            loss = F.cross_entropy(logits[mask], seg_ids[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach() * mask.sum(), mask.sum().float()])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} mlm_loss {(meter[0] / meter[1]).item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if rank == 0 and (epoch + 1) % args.probe_every == 0:
            model.eval()
            with torch.no_grad():
                emb = model.encode_roads(x, edge_index).float().cpu().numpy()
            mi, ma = probe_road_type(emb, road_type, args.seed)
            print(f"  probe road-type micro-F1 {mi:.4f} macro-F1 {ma:.4f}")
            np.save(os.path.join(args.out, f"{args.city}_seg_emb_ep{epoch + 1}.npy"), emb)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"{args.city}_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
