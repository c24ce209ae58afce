"""SuperGlue-style matcher on MegaDepth with pre-extracted SuperPoint features and cached GT matches.

Run on 2 nodes x 8 GPUs:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        03_superglue_megadepth_pose.py --config configs/superglue_md.yaml
"""
import argparse
import logging
import os

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = OmegaConf.create({
    "data": {"root": "/mnt/shared/megadepth_sp", "train_pairs": "train_pairs.txt", "val_pairs": "val_1500.txt",
             "max_kpts": 1024},
    "model": {"dim": 256, "layers": 9, "sinkhorn_iters": 50},
    "train": {"batch_size": 8, "lr": 1e-4, "epochs": 50, "decay_start": 10, "workers": 6,
              "out": "/mnt/shared/runs/superglue_md"},
    "eval": {"match_thr": 0.2, "ransac_thr": 0.5},
})

log = logging.getLogger(__name__)


class PairFeatures(Dataset):
    """h5 per pair: kpts0/kpts1 (N,2), desc0/desc1 (256,N), scores0/1, matches0 (N,) with -1 unmatched,
    K0, K1, T_0to1."""

    def __init__(self, root, list_file, max_kpts):
        with open(os.path.join(root, list_file)) as f:
            self.files = [os.path.join(root, "pairs", l.strip() + ".h5") for l in f if l.strip()]
        self.max_kpts = max_kpts

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with h5py.File(self.files[i], "r") as f:
            d = {k: f[k][()] for k in ("kpts0", "kpts1", "desc0", "desc1", "scores0", "scores1",
                                       "matches0", "K0", "K1", "T_0to1", "shape0", "shape1")}
        out = {}
        for s in "01":
            n = min(len(d["kpts" + s]), self.max_kpts)
            k = np.zeros((self.max_kpts, 2), np.float32)
            de = np.zeros((256, self.max_kpts), np.float32)
            sc = np.zeros(self.max_kpts, np.float32)
            k[:n], de[:, :n], sc[:n] = d["kpts" + s][:n], d["desc" + s][:, :n], d["scores" + s][:n]
            out["kpts" + s], out["desc" + s], out["scores" + s] = k, de, sc
            out["n" + s] = n
            out["shape" + s] = d["shape" + s].astype(np.float32)
        m0 = np.full(self.max_kpts, -1, np.int64)
        mm = d["matches0"][: out["n0"]].astype(np.int64)
        mm[mm >= out["n1"]] = -1
        m0[: out["n0"]] = mm
        out["matches0"] = m0
        for k in ("K0", "K1", "T_0to1"):
            out[k] = d[k].astype(np.float32)
        return out


def MLP(channels):
    layers = []
    for i in range(1, len(channels)):
        layers.append(nn.Conv1d(channels[i - 1], channels[i], 1, bias=True))
        if i < len(channels) - 1:
            layers += [nn.InstanceNorm1d(channels[i]), nn.ReLU()]
    return nn.Sequential(*layers)


class AttentionalProp(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = MLP([2 * dim, 2 * dim, dim])
        nn.init.constant_(self.mlp[-1].bias, 0.0)

    def forward(self, x, src, key_padding_mask):
        msg, _ = self.attn(x.transpose(1, 2), src.transpose(1, 2), src.transpose(1, 2),
                           key_padding_mask=key_padding_mask, need_weights=False)
        return self.mlp(torch.cat([x, msg.transpose(1, 2)], 1))


def log_sinkhorn(Z, log_mu, log_nu, iters):
    u, v = torch.zeros_like(log_mu), torch.zeros_like(log_nu)
    for _ in range(iters):
        u = log_mu - torch.logsumexp(Z + v.unsqueeze(1), dim=2)
        v = log_nu - torch.logsumexp(Z + u.unsqueeze(2), dim=1)
    return Z + u.unsqueeze(2) + v.unsqueeze(1)


class SuperGlue(nn.Module):
    def __init__(self, dim=256, layers=9, sinkhorn_iters=50):
        super().__init__()
        self.kenc = MLP([3, 32, 64, 128, 256, dim])
        self.gnn = nn.ModuleList([AttentionalProp(dim) for _ in range(2 * layers)])
        self.final_proj = nn.Conv1d(dim, dim, 1)
        self.bin_score = nn.Parameter(torch.tensor(1.0))
        self.iters = sinkhorn_iters

    def forward(self, data):
        k0 = self.normalize(data["kpts0"], data["shape0"])
        k1 = self.normalize(data["kpts1"], data["shape1"])
        ar = torch.arange(k0.size(1), device=k0.device)[None]
        pad0, pad1 = ar >= data["n0"][:, None], ar >= data["n1"][:, None]
        d0 = data["desc0"] + self.kenc(torch.cat([k0.transpose(1, 2), data["scores0"][:, None]], 1))
        d1 = data["desc1"] + self.kenc(torch.cat([k1.transpose(1, 2), data["scores1"][:, None]], 1))
        for i, layer in enumerate(self.gnn):
            if i % 2 == 0:
                d0, d1 = d0 + layer(d0, d0, pad0), d1 + layer(d1, d1, pad1)
            else:
                d0, d1 = d0 + layer(d0, d1, pad1), d1 + layer(d1, d0, pad0)
        m0, m1 = self.final_proj(d0), self.final_proj(d1)
        scores = torch.einsum("bdn,bdm->bnm", m0, m1) / m0.size(1) ** 0.5
        scores = scores.masked_fill(pad0[:, :, None] | pad1[:, None, :], -1e4)
        return self.optimal_transport(scores, data["n0"], data["n1"])

    @staticmethod
    def normalize(kpts, shape):
        h, w = shape[:, 0:1], shape[:, 1:2]
        center = torch.stack([w, h], -1) / 2
        return (kpts - center) / (torch.maximum(w, h)[..., None] * 0.7)

    def optimal_transport(self, scores, n0, n1):
        b, m, n = scores.shape
        bins0 = self.bin_score.expand(b, m, 1)
        bins1 = self.bin_score.expand(b, 1, n)
        alpha = self.bin_score.expand(b, 1, 1)
        Z = torch.cat([torch.cat([scores, bins0], -1), torch.cat([bins1, alpha], -1)], 1)
        n0f, n1f = n0.float(), n1.float()
        norm = -(n0f + n1f).log()
        ar_m = torch.arange(m, device=scores.device)[None]
        ar_n = torch.arange(n, device=scores.device)[None]
        log_mu = torch.where(ar_m < n0[:, None], norm[:, None], torch.full_like(ar_m, -1e4, dtype=torch.float))
        log_nu = torch.where(ar_n < n1[:, None], norm[:, None], torch.full_like(ar_n, -1e4, dtype=torch.float))
        log_mu = torch.cat([log_mu, (n1f.log() + norm)[:, None]], 1)
        log_nu = torch.cat([log_nu, (n0f.log() + norm)[:, None]], 1)
        return log_sinkhorn(Z, log_mu, log_nu, self.iters) - norm[:, None, None]


def matching_loss(P, matches0, n0):
    b, m = matches0.shape
    valid = torch.arange(m, device=P.device)[None] < n0[:, None]
    tgt = torch.where(matches0 >= 0, matches0, torch.full_like(matches0, P.size(2) - 1))
    ll = P[:, :m].gather(2, tgt[..., None])[..., 0]
    return -(ll * valid).sum() / valid.sum().clamp(min=1)


def estimate_pose_error(kp0, kp1, K0, K1, T_0to1, thr):
    if len(kp0) < 5:
        return 180.0
    f = np.mean([K0[0, 0], K1[0, 0], K0[1, 1], K1[1, 1]])
    n0 = (kp0 - K0[[0, 1], [2, 2]]) / K0[[0, 1], [0, 1]]
    n1 = (kp1 - K1[[0, 1], [2, 2]]) / K1[[0, 1], [0, 1]]
    E, mask = cv2.findEssentialMat(n0, n1, np.eye(3), threshold=thr / f, prob=0.99999, method=cv2.RANSAC)
    if E is None:
        return 180.0
    best_err = 180.0
    for _E in np.split(E, len(E) // 3):
        n, R, t, _ = cv2.recoverPose(_E, n0, n1, np.eye(3), 1e9, mask=mask)
        t_gt = T_0to1[:3, 3]
        et = np.rad2deg(np.arccos(np.clip(np.dot(t.ravel(), t_gt) / np.linalg.norm(t_gt), -1, 1)))
        et = min(et, 180 - et)
        er = np.rad2deg(np.abs(np.arccos(np.clip((np.trace(R.T @ T_0to1[:3, :3]) - 1) / 2, -1, 1))))
        best_err = min(best_err, max(et, er))
    return best_err


def pose_auc(errors, thresholds=(5, 10, 20)):
    errors = np.sort(np.asarray(errors))
    recall = (np.arange(len(errors)) + 1) / len(errors)
    errors, recall = np.r_[0.0, errors], np.r_[0.0, recall]
    res = []
    for t in thresholds:
        i = np.searchsorted(errors, t)
        res.append(np.trapz(np.r_[recall[:i], recall[i - 1]], x=np.r_[errors[:i], t]) / t)
    return res


@torch.no_grad()
def run_validation(model, loader, device, cfg):
    model.eval()
    errs = []
    for data in loader:
        data = {k: v.to(device) for k, v in data.items()}
        P = model(data)[:, :-1, :-1].exp()
        for b in range(P.size(0)):
            n0, n1 = int(data["n0"][b]), int(data["n1"][b])
            p = P[b, :n0, :n1]
            v0, i0 = p.max(1)
            mutual = p.max(0).indices[i0] == torch.arange(n0, device=device)
            keep = mutual & (v0 > cfg.eval.match_thr)
            kp0 = data["kpts0"][b, :n0][keep].cpu().numpy()
            kp1 = data["kpts1"][b, :n1][i0[keep]].cpu().numpy()
            errs.append(estimate_pose_error(kp0, kp1, data["K0"][b].cpu().numpy(), data["K1"][b].cpu().numpy(),
                                            data["T_0to1"][b].cpu().numpy(), cfg.eval.ransac_thr))
    model.train()
    return errs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    cfg = DEFAULTS
    if a.config:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(a.config))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    train_ds = PairFeatures(cfg.data.root, cfg.data.train_pairs, cfg.data.max_kpts)
    val_ds = PairFeatures(cfg.data.root, cfg.data.val_pairs, cfg.data.max_kpts)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.train.batch_size, sampler=train_sampler, num_workers=cfg.train.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 4, sampler=val_sampler, num_workers=4)

    model = DDP(SuperGlue(**cfg.model).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: 1.0 if e < cfg.train.decay_start else 0.95 ** (e - cfg.train.decay_start))

    writer = None
    if rank == 0:
        os.makedirs(cfg.train.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.train.out, "config.yaml"))
        writer = SummaryWriter(os.path.join(cfg.train.out, "tb"))

    best_auc = -1.0
    gstep = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for data in train_dl:
            data = {k: v.to(device, non_blocking=True) for k, v in data.items()}
            loss = matching_loss(model(data), data["matches0"], data["n0"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            gstep += 1
            if gstep % 200 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    writer.add_scalar("train/loss", (running[0] / running[1]).item(), gstep)
                running.zero_()
        sched.step()

        errors = run_validation(model, val_dl, device, cfg)
        aucs = pose_auc(errors)
        if rank == 0:
            log.info("epoch %d  pose AUC@5/10/20  %.2f %.2f %.2f", epoch, *[100 * x for x in aucs])
            for t, v in zip((5, 10, 20), aucs):
                writer.add_scalar(f"val/auc@{t}", v, epoch)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                     "cfg": OmegaConf.to_container(cfg)}
            torch.save(state, os.path.join(cfg.train.out, "last.pth"))
            if aucs[0] > best_auc:
                best_auc = aucs[0]
                torch.save(state, os.path.join(cfg.train.out, "best.pth"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
