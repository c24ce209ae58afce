"""MTP-style multimodal predictor with lane and neighbour attention, nuScenes prediction challenge.

Raw nuScenes annotations are turned into agent-centric samples once (PredictHelper + map API)
and cached as pickles next to the dataset.

    torchrun --nproc_per_node=8 10_nusc_mtp_lane_attention.py --dataroot /data/sets/nuscenes
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nuscenes import NuScenes
from nuscenes.eval.common.utils import quaternion_yaw
from nuscenes.eval.prediction.splits import get_prediction_challenge_split
from nuscenes.map_expansion.map_api import NuScenesMap
from nuscenes.prediction import PredictHelper, convert_global_coords_to_local
from pyquaternion import Quaternion
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST_S, FUT_S, HZ = 2, 6, 2
MAX_NBR, MAX_LANES, LANE_PTS = 24, 48, 20


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", default="/data/sets/nuscenes")
    p.add_argument("--cache-dir", default="/data/sets/nuscenes/pred_cache")
    p.add_argument("--ckpt-dir", default="/data/runs/mtp_lane_attn")
    p.add_argument("--modes", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="for global batch 512")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def pad(arr, n, shape):
    out = np.zeros((n, *shape), dtype=np.float32)
    m = min(n, len(arr))
    if m:
        out[:m] = np.asarray(arr[:m], dtype=np.float32)
    return out, np.arange(n) < m


def build_samples(nusc, split, dataroot):
    helper = PredictHelper(nusc)
    maps = {}
    samples = []
    for token in get_prediction_challenge_split(split, dataroot=dataroot):
        inst, sample = token.split("_")
        ann = helper.get_sample_annotation(inst, sample)
        loc = helper.get_map_name_from_sample_token(sample)
        if loc not in maps:
            maps[loc] = NuScenesMap(dataroot=dataroot, map_name=loc)
        past = helper.get_past_for_agent(inst, sample, HIST_S, in_agent_frame=True)[::-1]
        fut = helper.get_future_for_agent(inst, sample, FUT_S, in_agent_frame=True)
        nbrs = []
        for other in helper.get_annotations_for_sample(sample):
            if other["instance_token"] == inst:
                continue
            xy = np.asarray(other["translation"][:2])
            if np.linalg.norm(xy - np.asarray(ann["translation"][:2])) > 40:
                continue
            tr = helper.get_past_for_agent(other["instance_token"], sample, HIST_S, in_agent_frame=False)[::-1]
            tr = np.concatenate([tr.reshape(-1, 2), xy[None]], 0)[-(HIST_S * HZ + 1):]
            loc_tr = convert_global_coords_to_local(tr, ann["translation"], ann["rotation"])
            nbrs.append(np.pad(loc_tr, ((HIST_S * HZ + 1 - len(loc_tr), 0), (0, 0)), mode="edge"))
        nmap = maps[loc]
        x, y = ann["translation"][:2]
        lane_ids = nmap.get_records_in_radius(x, y, 50, ["lane", "lane_connector"])
        lanes = []
        for lid in lane_ids["lane"] + lane_ids["lane_connector"]:
            pts = np.asarray(nmap.discretize_lanes([lid], 1.0)[lid])[:, :2]
            idx = np.linspace(0, len(pts) - 1, LANE_PTS).round().astype(int)
            lanes.append(convert_global_coords_to_local(pts[idx], ann["translation"], ann["rotation"]))
        lanes.sort(key=lambda l: np.linalg.norm(l, axis=1).min())
        hist = np.concatenate([past.reshape(-1, 2), np.zeros((1, 2))], 0)
        hist = np.pad(hist, ((HIST_S * HZ + 1 - len(hist), 0), (0, 0)), mode="edge")
        state = [helper.get_velocity_for_agent(inst, sample), helper.get_acceleration_for_agent(inst, sample),
                 helper.get_heading_change_rate_for_agent(inst, sample)]
        samples.append({"token": token, "hist": hist.astype(np.float32), "fut": fut.astype(np.float32),
                        "state": np.nan_to_num(np.asarray(state, dtype=np.float32)),
                        "nbrs": nbrs[:MAX_NBR], "lanes": lanes[:MAX_LANES],
                        "yaw": quaternion_yaw(Quaternion(ann["rotation"]))})
    return samples


def load_split(args, split):
    path = os.path.join(args.cache_dir, f"{split}.pkl")
    if not os.path.exists(path):
        nusc = NuScenes("v1.0-trainval", dataroot=args.dataroot, verbose=False)
        samples = build_samples(nusc, split, args.dataroot)
        os.makedirs(args.cache_dir, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(samples, f, protocol=pickle.HIGHEST_PROTOCOL)
        return samples
    with open(path, "rb") as f:
        return pickle.load(f)


class PredDataset(Dataset):
    def __init__(self, samples):
        self.samples = [s for s in samples if len(s["fut"]) == FUT_S * HZ]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        nbrs, nmask = pad(s["nbrs"], MAX_NBR, (HIST_S * HZ + 1, 2))
        lanes, lmask = pad(s["lanes"], MAX_LANES, (LANE_PTS, 2))
        return (torch.from_numpy(s["hist"]), torch.from_numpy(s["state"]), torch.from_numpy(nbrs),
                torch.from_numpy(nmask), torch.from_numpy(lanes), torch.from_numpy(lmask), torch.from_numpy(s["fut"]))


class LaneAttnMTP(nn.Module):
    def __init__(self, dim, modes):
        super().__init__()
        self.modes = modes
        self.hist_enc = nn.LSTM(2, dim, batch_first=True)
        self.nbr_enc = nn.LSTM(2, dim, batch_first=True)
        self.lane_enc = nn.Sequential(nn.Linear(2, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.state_enc = nn.Linear(3, dim)
        self.nbr_attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.lane_attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = nn.Sequential(nn.Linear(3 * dim, 512), nn.ReLU(), nn.Linear(512, modes * (FUT_S * HZ * 2 + 1)))

    def forward(self, hist, state, nbrs, nmask, lanes, lmask):
        B = hist.shape[0]
        _, (h, _) = self.hist_enc(hist)
        q = (h[-1] + self.state_enc(state)).unsqueeze(1)
        _, (hn, _) = self.nbr_enc(nbrs.flatten(0, 1))
        nb = hn[-1].view(B, MAX_NBR, -1)
        nmask = nmask.clone()
        nmask[:, 0] = True  # keep attention defined when there are no neighbours (slot is zero-padded)
        nctx, _ = self.nbr_attn(q, nb, nb, key_padding_mask=~nmask)
        ln = self.lane_enc(lanes).max(2).values
        lmask = lmask.clone()
        lmask[:, 0] = True
        lctx, _ = self.lane_attn(q, ln, ln, key_padding_mask=~lmask)
        out = self.head(torch.cat([q, nctx, lctx], -1).squeeze(1)).view(B, self.modes, -1)
        return out[..., :-1].view(B, self.modes, FUT_S * HZ, 2), out[..., -1]


def mtp_loss(trajs, logits, fut):
    err = torch.norm(trajs - fut[:, None], dim=-1).mean(-1)
    best = err.argmin(1)
    return F.smooth_l1_loss(trajs[torch.arange(len(best)), best], fut) + F.cross_entropy(logits, best)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = PredDataset(load_split(args, "train"))
    val_ds = PredDataset(load_split(args, "val"))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size,
                        num_workers=args.workers, pin_memory=True)

    net = LaneAttnMTP(args.dim, args.modes).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.3)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"train {len(train_ds)} val {len(val_ds)} world {world} lr {lr:.2e}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for batch in train_dl:
            *inp, fut = [t.to(device, non_blocking=True) for t in batch]
            trajs, logits = model(*inp)
            loss = mtp_loss(trajs, logits, fut)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        net.eval()
        m = torch.zeros(5, device=device)  # minADE5, minADE10, minFDE1, MR2@5, n
        with torch.no_grad():
            for batch in val_dl:
                *inp, fut = [t.to(device) for t in batch]
                trajs, logits = net(*inp)
                order = logits.argsort(-1, descending=True)
                trajs = trajs.gather(1, order[..., None, None].expand_as(trajs))
                err = torch.norm(trajs - fut[:, None], dim=-1)
                m[0] += err[:, :5].mean(-1).min(-1).values.sum()
                m[1] += err.mean(-1).min(-1).values.sum()
                m[2] += err[:, 0, -1].sum()
                m[3] += (err[:, :5].max(-1).values.min(-1).values > 2).float().sum()
                m[4] += fut.shape[0]
        dist.all_reduce(m)
        m = (m[:4] / m[4]).tolist()
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.3f} minADE5 {m[0]:.3f} minADE10 {m[1]:.3f} "
                  f"minFDE1 {m[2]:.3f} MR5 {m[3]:.3f} [{time.time() - t0:.0f}s]", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.ckpt_dir, "last.pth"))
            if m[1] < best:
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.ckpt_dir, "best.pth"))
        best = min(best, m[1])
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
