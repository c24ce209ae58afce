"""Group activity recognition from tracked players (volleyball-style broadcast).

Per clip we have T frames x N tracked players; each player has a RoIAlign
feature from a frozen I3D trunk (pre-extracted, see tools/extract_roi_feats.py)
and a box. A player-level transformer mixes players within a frame, a temporal
GRU pools over time, and two heads predict
  * the individual action of each player (waiting, setting, spiking, ...)
  * the team-level group activity (l-set, r-spike, l-pass, ...)
The group head is switched on after a few epochs of person-level training, which
gives noticeably more stable group accuracy.

    torchrun --nproc_per_node=4 07_group_activity_team_head.py --data /data/volleyball_feats
"""
import argparse
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ACTIONS = ["waiting", "setting", "digging", "falling", "spiking", "blocking", "jumping", "moving", "standing"]
ACTIVITIES = ["r_set", "r_spike", "r-pass", "r_winpoint", "l_set", "l-spike", "l-pass", "l_winpoint"]
TRAIN_VIDEOS = [1, 3, 6, 7, 10, 13, 15, 16, 18, 22, 23, 31, 32, 36, 38, 39, 40, 41, 42, 48, 50, 52, 53, 54,
                0, 2, 8, 12, 17, 19, 24, 26, 27, 28, 30, 33, 46, 49, 51]
TEST_VIDEOS = [4, 5, 9, 11, 14, 20, 21, 25, 29, 34, 35, 37, 43, 44, 45, 47]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--num-players", type=int, default=12)
    p.add_argument("--frames", type=int, default=10)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--group-start-epoch", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4, help="per 16 clips")
    p.add_argument("--out", type=Path, default=Path("ckpts/gar"))
    return p.parse_args()


class RoIFeatureClips(Dataset):
    """Each item: feats (T, N, D), boxes (T, N, 4) normalised, actions (N,), activity ()"""

    def __init__(self, root, videos, num_players, frames, train):
        self.items = []
        for v in videos:
            with open(root / f"{v}.pkl", "rb") as f:
                self.items.extend(pickle.load(f))
        self.N, self.T, self.train = num_players, frames, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        feats, boxes = it["feats"], it["boxes"]
        T0 = feats.shape[0]
        if self.train:
            s = np.random.randint(0, T0 - self.T + 1)
        else:
            s = (T0 - self.T) // 2
        feats, boxes = feats[s:s + self.T], boxes[s:s + self.T]
        n = feats.shape[1]
        actions = np.full(self.N, -1, np.int64)
        actions[: min(n, self.N)] = it["actions"][: self.N]
        if n < self.N:
            feats = np.pad(feats, ((0, 0), (0, self.N - n), (0, 0)))
            boxes = np.pad(boxes, ((0, 0), (0, self.N - n), (0, 0)))
        mask = np.zeros(self.N, bool)
        mask[: min(n, self.N)] = True
        return (torch.from_numpy(feats[:, : self.N]).float(), torch.from_numpy(boxes[:, : self.N]).float(),
                torch.from_numpy(mask), torch.from_numpy(actions), it["activity"])


class GroupActivityNet(nn.Module):
    def __init__(self, in_dim, dim, n_act, n_grp):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.box_embed = nn.Sequential(nn.Linear(4, dim), nn.ReLU(), nn.Linear(dim, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True)
        self.spatial = nn.TransformerEncoder(layer, num_layers=2)
        self.temporal = nn.GRU(dim, dim, batch_first=True)
        self.action_head = nn.Linear(dim, n_act)
        self.group_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(0.3), nn.Linear(dim, n_grp))

    def forward(self, feats, boxes, mask, with_group=True):
        B, T, N, _ = feats.shape
        h = self.embed(feats) + self.box_embed(boxes)
        h = self.spatial(h.flatten(0, 1), src_key_padding_mask=~mask.repeat_interleave(T, 0)).view(B, T, N, -1)
        h, _ = self.temporal(h.permute(0, 2, 1, 3).flatten(0, 1))       # (B*N, T, D)
        person = h[:, -1].view(B, N, -1)
        act_logits = self.action_head(person)
        grp_logits = None
        if with_group:
            pooled = (person * mask.unsqueeze(-1)).amax(1)
            grp_logits = self.group_head(pooled)
        return act_logits, grp_logits


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(4, device=device)
    for feats, boxes, mask, actions, activity in loader:
        feats, boxes, mask = feats.to(device), boxes.to(device), mask.to(device)
        actions, activity = actions.to(device), activity.to(device)
        act_logits, grp_logits = net(feats, boxes, mask)
        valid = actions >= 0
        s[0] += (act_logits.argmax(-1)[valid] == actions[valid]).sum()
        s[1] += valid.sum()
        s[2] += (grp_logits.argmax(-1) == activity).sum()
        s[3] += activity.numel()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item(), (s[2] / s[3]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = RoIFeatureClips(args.data, TRAIN_VIDEOS, args.num_players, args.frames, train=True)
    test_ds = RoIFeatureClips(args.data, TEST_VIDEOS, args.num_players, args.frames, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True,
                          pin_memory=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=args.batch_size, num_workers=4)

    in_dim = train_ds.items[0]["feats"].shape[-1]
    net = GroupActivityNet(in_dim, args.dim, len(ACTIONS), len(ACTIVITIES)).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 16
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.3)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_group = epoch >= args.group_start_epoch
        t0 = time.time()
        for feats, boxes, mask, actions, activity in train_dl:
            feats, boxes, mask = feats.to(device), boxes.to(device), mask.to(device)
            actions, activity = actions.to(device), activity.to(device)
            act_logits, grp_logits = model(feats, boxes, mask, with_group=use_group)
            loss = F.cross_entropy(act_logits.flatten(0, 1), actions.flatten(), ignore_index=-1)
            if use_group:
                loss = loss + F.cross_entropy(grp_logits, activity)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        act_acc, grp_acc = evaluate(net, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch:3d} ({time.time() - t0:.0f}s) loss {loss.item():.3f} "
                  f"action acc {act_acc:.4f} group acc {grp_acc:.4f}", flush=True)
            if grp_acc > best:
                best = grp_acc
                torch.save({"model": net.state_dict(), "epoch": epoch, "group_acc": grp_acc}, args.out / "best.pth")
        dist.barrier()
    if rank == 0:
        print(f"best group activity accuracy {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
