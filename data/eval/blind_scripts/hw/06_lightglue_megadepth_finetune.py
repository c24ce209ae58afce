"""Fine-tune LightGlue (SuperPoint features) on MegaDepth with depth-derived ground truth.

    torchrun --nproc_per_node=4 06_lightglue_megadepth_finetune.py \
        --conf configs/lightglue_md.yaml --init weights/superpoint_lightglue_homography.pth
"""
import argparse
import math
import os
from types import SimpleNamespace

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULT_CONF = {
    "data_dir": "/data/megadepth/sp_2048", "train_split": "train_scenes_clean.txt", "val_split": "valid_pairs.txt",
    "max_kpts": 2048, "n_layers": 9, "dim": 256, "heads": 4, "depth_confidence": 0.95, "width_confidence": 0.99,
    "filter_threshold": 0.1, "batch_size": 8, "lr": 1e-4, "lr_decay_start": 30, "epochs": 50, "workers": 8,
    "out": "outputs/lightglue_md", "mixed_precision": True,
}


class MDFeaturePairs(Dataset):
    def __init__(self, data_dir, split_file, max_kpts):
        with open(os.path.join(data_dir, split_file)) as f:
            self.keys = [l.strip() for l in f if l.strip()]
        self.h5 = os.path.join(data_dir, "pairs.h5")
        self.max_kpts = max_kpts
        self._f = None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if self._f is None:  # open lazily, once per worker
            self._f = h5py.File(self.h5, "r")
        g = self._f[self.keys[i]]
        out = {}
        for s in ("0", "1"):
            k = g["keypoints" + s][: self.max_kpts]
            d = g["descriptors" + s][: self.max_kpts]
            n = len(k)
            kp = np.zeros((self.max_kpts, 2), np.float32)
            de = np.zeros((self.max_kpts, d.shape[-1]), np.float32)
            kp[:n], de[:n] = k, d
            out["keypoints" + s], out["descriptors" + s] = kp, de
            out["mask" + s] = np.arange(self.max_kpts) < n
            out["image_size" + s] = g["image_size" + s][()].astype(np.float32)
            out["K" + s] = g["K" + s][()].astype(np.float32)
        gt = np.full(self.max_kpts, -2, np.int64)  # -2 ignore, -1 unmatched
        m = g["gt_matches0"][: self.max_kpts].astype(np.int64)
        m[m >= self.max_kpts] = -2
        gt[: len(m)] = m
        out["gt_matches0"] = gt
        out["T_0to1"] = g["T_0to1"][()].astype(np.float32)
        return out


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), -1).flatten(-2)


class FourierPE(nn.Module):
    def __init__(self, head_dim, gamma=1.0):
        super().__init__()
        self.Wr = nn.Linear(2, head_dim // 2, bias=False)
        nn.init.normal_(self.Wr.weight.data, mean=0, std=gamma ** -2)

    def forward(self, x):
        p = self.Wr(x)
        return torch.stack([p.cos(), p.sin()], 0).unsqueeze(-3).repeat_interleave(2, -1)


class TransformerLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.Wqkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.LayerNorm(2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.to_qk = nn.Linear(d, d)
        self.to_v = nn.Linear(d, d)
        self.to_out = nn.Linear(d, d)
        self.cross_ffn = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.LayerNorm(2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def self_block(self, x, enc, mask):
        qkv = self.Wqkv(x).unflatten(-1, (self.h, -1, 3)).transpose(1, 2)
        q, k, v = qkv[..., 0], qkv[..., 1], qkv[..., 2]
        q = q * enc[0] + rotate_half(q) * enc[1]
        k = k * enc[0] + rotate_half(k) * enc[1]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None])
        return x + self.ffn(torch.cat([x, self.out_proj(ctx.transpose(1, 2).flatten(-2))], -1))

    def cross_block(self, x0, x1, m0, m1):
        split = lambda t: t.unflatten(-1, (self.h, -1)).transpose(1, 2)
        qk0, qk1 = split(self.to_qk(x0)), split(self.to_qk(x1))
        v0, v1 = split(self.to_v(x0)), split(self.to_v(x1))
        sim = qk0 @ qk1.transpose(-1, -2) / math.sqrt(qk0.size(-1))
        sim = sim.masked_fill(~(m0[:, None, :, None] & m1[:, None, None, :]), -float("inf"))
        a01 = sim.softmax(-1).nan_to_num()
        a10 = sim.transpose(-1, -2).softmax(-1).nan_to_num()
        msg0 = self.to_out((a01 @ v1).transpose(1, 2).flatten(-2))
        msg1 = self.to_out((a10 @ v0).transpose(1, 2).flatten(-2))
        return x0 + self.cross_ffn(torch.cat([x0, msg0], -1)), x1 + self.cross_ffn(torch.cat([x1, msg1], -1))

    def forward(self, x0, x1, e0, e1, m0, m1):
        return self.cross_block(self.self_block(x0, e0, m0), self.self_block(x1, e1, m1), m0, m1)


class MatchAssignment(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.matchability = nn.Linear(d, 1)
        self.final_proj = nn.Linear(d, d)

    def forward(self, x0, x1, m0, m1):
        p0, p1 = self.final_proj(x0), self.final_proj(x1)
        sim = torch.einsum("bmd,bnd->bmn", p0, p1) / p0.size(-1) ** 0.5
        sim = sim.masked_fill(~(m0[:, :, None] & m1[:, None, :]), -1e4)
        z0, z1 = self.matchability(x0), self.matchability(x1)
        scores = sim.log_softmax(2) + sim.log_softmax(1) + F.logsigmoid(z0) + F.logsigmoid(z1).transpose(1, 2)
        return scores, F.logsigmoid(-z0)[..., 0], F.logsigmoid(-z1)[..., 0]


class TokenConfidence(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.token = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid())

    def forward(self, x0, x1):
        return self.token(x0.detach())[..., 0], self.token(x1.detach())[..., 0]


class LightGlue(nn.Module):
    def __init__(self, conf):
        super().__init__()
        self.conf = conf
        d = conf.dim
        self.input_proj = nn.Linear(256, d)
        self.posenc = FourierPE(d // conf.heads)
        self.transformers = nn.ModuleList([TransformerLayer(d, conf.heads) for _ in range(conf.n_layers)])
        self.log_assignment = nn.ModuleList([MatchAssignment(d) for _ in range(conf.n_layers)])
        self.token_confidence = nn.ModuleList([TokenConfidence(d) for _ in range(conf.n_layers - 1)])

    def confidence_threshold(self, i):
        return np.clip(0.8 + 0.1 * np.exp(-4.0 * i / self.conf.n_layers), 0, 1)

    def forward(self, data):
        def norm(k, size):
            return (k - size[:, None] / 2) / (size.max(-1).values[:, None, None] / 2)

        m0, m1 = data["mask0"], data["mask1"]
        x0, x1 = self.input_proj(data["descriptors0"]), self.input_proj(data["descriptors1"])
        e0 = self.posenc(norm(data["keypoints0"], data["image_size0"]))
        e1 = self.posenc(norm(data["keypoints1"], data["image_size1"]))
        early_stop = self.conf.depth_confidence > 0 and not self.training
        outs = []
        for i in range(self.conf.n_layers):
            x0, x1 = self.transformers[i](x0, x1, e0, e1, m0, m1)
            if self.training:
                outs.append(self.log_assignment[i](x0, x1, m0, m1))
            elif early_stop and i < self.conf.n_layers - 1:
                c0, c1 = self.token_confidence[i](x0, x1)
                conf = torch.cat([c0[m0], c1[m1]])
                if (conf > self.confidence_threshold(i)).float().mean() > self.conf.depth_confidence:
                    break
        if not self.training:
            outs.append(self.log_assignment[i](x0, x1, m0, m1))
        return outs


def nll(outs, gt0, m0, m1):
    pos = gt0 >= 0
    neg0 = (gt0 == -1) & m0
    b, i = pos.nonzero(as_tuple=True)
    # matches1 derived from matches0: points in image 1 without a partner are negatives
    matched1 = torch.zeros_like(m1)
    matched1[b, gt0[b, i]] = True
    neg1 = m1 & ~matched1
    losses = []
    for scores, u0, u1 in outs:
        lp = -scores[b, i, gt0[b, i]].sum()
        ln = -(u0 * neg0).sum() - (u1 * neg1).sum()
        losses.append((lp + ln) / (pos.sum() + neg0.sum() + neg1.sum()).clamp(min=1))
    return torch.stack(losses).mean(), losses[-1]


def pose_error(kp0, kp1, K0, K1, T):
    if len(kp0) < 5:
        return 180.0
    E, mask = cv2.findEssentialMat(kp0, kp1, K0, method=cv2.USAC_MAGSAC, prob=0.99999, threshold=1.0)
    if E is None or E.shape != (3, 3):
        return 180.0
    _, R, t, _ = cv2.recoverPose(E, kp0, kp1, K0, mask=mask)
    t, tg = t.ravel(), T[:3, 3]
    et = np.degrees(np.arccos(np.clip(t @ tg / (np.linalg.norm(tg) + 1e-9), -1, 1)))
    er = np.degrees(np.arccos(np.clip((np.trace(R.T @ T[:3, :3]) - 1) / 2, -1, 1)))
    return max(min(et, 180 - et), er)


@torch.no_grad()
def evaluate(net, loader, dev, thr):
    net.eval()
    errs = []
    for data in loader:
        data = {k: v.to(dev) for k, v in data.items()}
        scores = net(data)[-1][0].exp()
        for b in range(scores.size(0)):
            s = scores[b]
            v0, i0 = s.max(1)
            keep = (s.max(0).indices[i0] == torch.arange(len(i0), device=dev)) & (v0 > thr) & data["mask0"][b]
            kp0 = data["keypoints0"][b][keep].double().cpu().numpy()
            kp1 = data["keypoints1"][b][i0[keep]].double().cpu().numpy()
            K = data["K0"][b].double().cpu().numpy()
            if not np.allclose(K, data["K1"][b].cpu().numpy()):  # normalise image 1 into camera 0
                K1 = data["K1"][b].double().cpu().numpy()
                kp1 = cv2.perspectiveTransform(kp1[None], K @ np.linalg.inv(K1))[0]
            errs.append(pose_error(kp0, kp1, K, K, data["T_0to1"][b].cpu().numpy()))
    net.train()
    return errs


def auc(errors, ths=(5, 10, 20)):
    e = np.r_[0.0, np.sort(errors)]
    r = np.r_[0.0, (np.arange(len(errors)) + 1) / len(errors)]
    out = []
    for t in ths:
        j = np.searchsorted(e, t)
        out.append(np.trapz(np.r_[r[:j], r[j - 1]], x=np.r_[e[:j], t]) / t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", default=None)
    ap.add_argument("--init", default=None)
    a = ap.parse_args()
    conf = dict(DEFAULT_CONF)
    if a.conf:
        with open(a.conf) as f:
            conf.update(yaml.safe_load(f))
    conf = SimpleNamespace(**conf)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_ds = MDFeaturePairs(conf.data_dir, conf.train_split, conf.max_kpts)
    val_ds = MDFeaturePairs(conf.data_dir, conf.val_split, conf.max_kpts)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, conf.batch_size, sampler=sampler, num_workers=conf.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 4, num_workers=4)

    model = LightGlue(conf)
    if a.init:
        sd = torch.load(a.init, map_location="cpu")
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("init from", a.init, "missing:", missing, "unexpected:", unexpected)
    model = DDP(model.to(dev), device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=conf.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda ep: 1.0 if ep < conf.lr_decay_start else 0.95 ** (ep - conf.lr_decay_start))
    scaler = torch.cuda.amp.GradScaler(enabled=conf.mixed_precision)
    writer = SummaryWriter(conf.out) if rank == 0 else None

    step = 0
    for epoch in range(conf.epochs):
        sampler.set_epoch(epoch)
        for data in train_dl:
            data = {k: v.to(dev, non_blocking=True) for k, v in data.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=conf.mixed_precision):
                outs = model(data)
            loss, last = nll([(s.float(), u0.float(), u1.float()) for s, u0, u1 in outs],
                             data["gt_matches0"], data["mask0"], data["mask1"])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if step % 100 == 0:
                t = torch.stack([loss.detach(), last.detach()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("loss/total", t[0].item(), step)
                    writer.add_scalar("loss/last_layer", t[1].item(), step)
            step += 1
        sched.step()

        errs = evaluate(model.module, val_dl, dev, conf.filter_threshold)
        gathered = [None] * world
        dist.all_gather_object(gathered, errs)
        if rank == 0:
            a5, a10, a20 = auc(np.concatenate([np.asarray(g, dtype=np.float64) for g in gathered]))
            print(f"epoch {epoch}  AUC@5 {a5:.4f}  AUC@10 {a10:.4f}  AUC@20 {a20:.4f}")
            for k, v in (("auc5", a5), ("auc10", a10), ("auc20", a20)):
                writer.add_scalar("val/" + k, v, epoch)
            os.makedirs(conf.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "conf": vars(conf)}, os.path.join(conf.out, "checkpoint_last.tar"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
