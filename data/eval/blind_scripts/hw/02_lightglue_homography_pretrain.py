# LightGlue pre-training on synthetic homographies (SuperPoint features extracted offline).
#
#   torchrun --standalone --nproc_per_node=4 02_lightglue_homography_pretrain.py \
#       --features /data/oxford_paris_1m/sp_h5 --pairs /data/oxford_paris_1m/pairs_train.txt \
#       --val_pairs /data/oxford_paris_1m/pairs_val.txt --out outputs/lg_sp_homography
import argparse
import json
import os
import random
from pathlib import Path

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--val_pairs", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("outputs/lightglue"))
    ap.add_argument("--n_layers", type=int, default=9)
    ap.add_argument("--min_layers", type=int, default=5, help="lower bound of the sampled depth")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--max_kpts", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--resume", type=Path, default=None)
    ap.add_argument("--wandb_project", default="lightglue")
    return ap.parse_args()


class HomographyFeaturePairs(Dataset):
    """Each line: name0 name1 followed by the 9 entries of H_0to1."""

    def __init__(self, feature_dir, pair_file, max_kpts):
        self.dir, self.max_kpts = feature_dir, max_kpts
        self.items = []
        for line in pair_file.read_text().splitlines():
            tok = line.split()
            self.items.append((tok[0], tok[1], np.array(tok[2:11], np.float32).reshape(3, 3)))

    def __len__(self):
        return len(self.items)

    def _read(self, name):
        with h5py.File(self.dir / f"{name}.h5", "r") as f:
            kpts = f["keypoints"][()]
            desc = f["descriptors"][()]
            scores = f["scores"][()]
            size = f["image_size"][()]
        order = np.argsort(-scores)[: self.max_kpts]
        kpts, desc = kpts[order], desc[order]
        n = len(kpts)
        # pad with random far-away points so every sample has max_kpts tokens
        pad_k = np.full((self.max_kpts, 2), -1e3, np.float32)
        pad_d = np.zeros((self.max_kpts, desc.shape[1]), np.float32)
        pad_k[:n], pad_d[:n] = kpts, desc
        valid = np.zeros(self.max_kpts, bool)
        valid[:n] = True
        return pad_k, pad_d, valid, size.astype(np.float32)

    def __getitem__(self, i):
        n0, n1, H = self.items[i]
        k0, d0, v0, s0 = self._read(n0)
        k1, d1, v1, s1 = self._read(n1)
        return dict(kpts0=k0, desc0=d0, valid0=v0, size0=s0, kpts1=k1, desc1=d1, valid1=v1, size1=s1, H=H, idx=i)


@torch.no_grad()
def homography_gt(kpts0, kpts1, valid0, valid1, H, thr=3.0):
    """Mutual nearest reprojection within thr px -> index of the match in the other image, -1 unmatched."""
    p = torch.cat([kpts0, torch.ones_like(kpts0[..., :1])], -1) @ H.transpose(1, 2)
    p = p[..., :2] / p[..., 2:].clamp(min=1e-8)
    dist01 = torch.cdist(p, kpts1)
    dist01 = dist01.masked_fill(~valid0[:, :, None] | ~valid1[:, None, :], float("inf"))
    m01 = dist01.argmin(2)
    m10 = dist01.argmin(1)
    b = torch.arange(kpts0.size(0), device=kpts0.device)[:, None]
    i0 = torch.arange(kpts0.size(1), device=kpts0.device)[None]
    mutual = m10[b, m01] == i0
    close = dist01.gather(2, m01[..., None])[..., 0] < thr
    gt0 = torch.where(mutual & close & valid0, m01, torch.full_like(m01, -1))
    gt1 = torch.full_like(m10, -1)
    bb, ii = (gt0 >= 0).nonzero(as_tuple=True)
    gt1[bb, gt0[bb, ii]] = ii
    return gt0, gt1


def normalize_keypoints(kpts, size):
    shift = size[:, None] / 2
    return (kpts - shift) / (size.max(-1).values[:, None, None] / 2)


class LearnableFourierPE(nn.Module):
    def __init__(self, dim, head_dim):
        super().__init__()
        self.Wr = nn.Linear(2, head_dim // 2, bias=False)
        nn.init.normal_(self.Wr.weight, std=1.0)

    def forward(self, x):
        proj = self.Wr(x)
        emb = torch.stack([proj.cos(), proj.sin()], 0).unsqueeze(-3)
        return emb.repeat_interleave(2, dim=-1)


def apply_rope(t, enc):
    x = t.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(-1)
    rot = torch.stack((-x2, x1), -1).flatten(-2)
    return t * enc[0] + rot * enc[1]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn_self = nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.LayerNorm(2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.qk_cross = nn.Linear(dim, dim)
        self.v_cross = nn.Linear(dim, dim)
        self.out_cross = nn.Linear(dim, dim)
        self.ffn_cross = nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.LayerNorm(2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def _split(self, x):
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def self_attn(self, x, enc, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = self._split(q), self._split(k), self._split(v)
        q, k = apply_rope(q, enc), apply_rope(k, enc)
        msg = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2).flatten(-2)
        return x + self.ffn_self(torch.cat([x, self.out(msg)], -1))

    def cross_attn(self, x0, x1, m0, m1):
        qk0, qk1 = self._split(self.qk_cross(x0)), self._split(self.qk_cross(x1))
        v0, v1 = self._split(self.v_cross(x0)), self._split(self.v_cross(x1))
        sim = torch.einsum("bhid,bhjd->bhij", qk0, qk1) / qk0.size(-1) ** 0.5
        sim = sim.masked_fill(~(m0[:, None, :, None] & m1[:, None, None, :]), -1e4)
        msg0 = torch.einsum("bhij,bhjd->bhid", sim.softmax(-1), v1).transpose(1, 2).flatten(-2)
        msg1 = torch.einsum("bhji,bhjd->bhid", sim.softmax(-2), v0).transpose(1, 2).flatten(-2)
        x0 = x0 + self.ffn_cross(torch.cat([x0, self.out_cross(msg0)], -1))
        x1 = x1 + self.ffn_cross(torch.cat([x1, self.out_cross(msg1)], -1))
        return x0, x1

    def forward(self, x0, x1, enc0, enc1, m0, m1):
        x0, x1 = self.self_attn(x0, enc0, m0), self.self_attn(x1, enc1, m1)
        return self.cross_attn(x0, x1, m0, m1)


class Assignment(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.matchability = nn.Linear(dim, 1)

    def forward(self, x0, x1, m0, m1):
        md0, md1 = self.proj(x0), self.proj(x1)
        sim = torch.einsum("bmd,bnd->bmn", md0, md1) / md0.size(-1) ** 0.5
        sim = sim.masked_fill(~(m0[:, :, None] & m1[:, None, :]), -1e4)
        z0, z1 = self.matchability(x0), self.matchability(x1)
        scores = F.log_softmax(sim, 2) + F.log_softmax(sim, 1) + F.logsigmoid(z0) + F.logsigmoid(z1).transpose(1, 2)
        return scores, F.logsigmoid(-z0).squeeze(-1), F.logsigmoid(-z1).squeeze(-1)


class LightGlue(nn.Module):
    def __init__(self, in_dim=256, dim=256, heads=4, n_layers=9):
        super().__init__()
        self.input_proj = nn.Linear(in_dim, dim)
        self.posenc = LearnableFourierPE(2, dim // heads)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(n_layers)])
        self.assign = nn.ModuleList([Assignment(dim) for _ in range(n_layers)])

    def forward(self, data, depth=None):
        depth = len(self.blocks) if depth is None else depth
        k0 = normalize_keypoints(data["kpts0"], data["size0"])
        k1 = normalize_keypoints(data["kpts1"], data["size1"])
        m0, m1 = data["valid0"], data["valid1"]
        x0, x1 = self.input_proj(data["desc0"]), self.input_proj(data["desc1"])
        enc0, enc1 = self.posenc(k0), self.posenc(k1)
        outputs = []
        for i in range(depth):
            x0, x1 = self.blocks[i](x0, x1, enc0, enc1, m0, m1)
            outputs.append(self.assign[i](x0, x1, m0, m1))
        return outputs


def nll_loss(outputs, gt0, gt1, m0, m1):
    total = 0.0
    for scores, unm0, unm1 in outputs:
        pos = gt0 >= 0
        b, i = pos.nonzero(as_tuple=True)
        l_pos = -scores[b, i, gt0[b, i]].sum()
        l_n0 = -(unm0 * ((gt0 < 0) & m0)).sum()
        l_n1 = -(unm1 * ((gt1 < 0) & m1)).sum()
        n = pos.sum() + ((gt0 < 0) & m0).sum() + ((gt1 < 0) & m1).sum()
        total = total + (l_pos + l_n0 + l_n1) / n.clamp(min=1)
    return total / len(outputs)


def corner_error(H_est, H_gt, size):
    w, h = size
    c = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32)[:, None]
    return float(np.linalg.norm(cv2.perspectiveTransform(c, H_est) - cv2.perspectiveTransform(c, H_gt), axis=-1).mean())


def auc(errors, thresholds):
    errors = np.sort(np.array(errors))
    recall = (np.arange(len(errors)) + 1) / len(errors)
    errors, recall = np.r_[0.0, errors], np.r_[0.0, recall]
    out = []
    for t in thresholds:
        last = np.searchsorted(errors, t)
        out.append(np.trapz(np.r_[recall[:last], recall[last - 1]], x=np.r_[errors[:last], t]) / t)
    return out


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    errors = []
    for data in loader:
        data = {k: v.to(device) for k, v in data.items()}
        scores = net(data)[-1][0].exp()
        for b in range(scores.size(0)):
            s = scores[b]
            mx0, mx1 = s.max(1), s.max(0)
            mutual = mx1.indices[mx0.indices] == torch.arange(s.size(0), device=device)
            keep = mutual & (mx0.values > 0.1) & data["valid0"][b]
            p0 = data["kpts0"][b][keep].cpu().numpy()
            p1 = data["kpts1"][b][mx0.indices[keep]].cpu().numpy()
            err = float("inf")
            if len(p0) >= 4:
                H, _ = cv2.findHomography(p0, p1, cv2.USAC_MAGSAC, 3.0, maxIters=10000)
                if H is not None:
                    err = corner_error(H, data["H"][b].cpu().numpy(), data["size0"][b].cpu().numpy())
            errors.append(err)
    net.train()
    return errors


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    torch.manual_seed(0)
    random.seed(1000 + rank)  # depth sampling is deliberately independent per rank

    train_set = HomographyFeaturePairs(args.features, args.pairs, args.max_kpts)
    val_set = HomographyFeaturePairs(args.features, args.val_pairs, args.max_kpts)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=16, num_workers=4)

    model = LightGlue(dim=args.dim, n_layers=args.n_layers).to(device)
    # layers deeper than the sampled depth (and their assignment heads) get no gradient in that step
    model = DDP(model, device_ids=[local_rank], output_device=local_rank, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda ep: 1.0 if ep < 20 else 0.8 ** (ep - 19))

    start_epoch, best = 0, float("inf")
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", best)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        wandb.init(project=args.wandb_project, name=args.out.name, config={k: str(v) for k, v in vars(args).items()})

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, data in enumerate(train_loader):
            data = {k: v.to(device, non_blocking=True) for k, v in data.items()}
            gt0, gt1 = homography_gt(data["kpts0"], data["kpts1"], data["valid0"], data["valid1"], data["H"])
            depth = random.randint(args.min_layers, args.n_layers)
            outputs = model(data, depth=depth)
            loss = nll_loss(outputs, gt0, gt1, data["valid0"], data["valid1"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if it % 50 == 0:
                stats = torch.tensor([loss.item(), float((gt0 >= 0).sum())], device=device)
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": stats[0].item(), "gt_matches": stats[1].item(), "depth": depth,
                               "lr": opt.param_groups[0]["lr"]})
        sched.step()

        local_errors = validate(model.module, val_loader, device)
        all_errors = [None] * world
        dist.all_gather_object(all_errors, local_errors)
        if rank == 0:
            errors = [e for part in all_errors for e in part]
            auc1, auc5, auc10 = auc(errors, [1, 5, 10])
            wandb.log({"val/H_auc@1px": auc1, "val/H_auc@5px": auc5, "val/H_auc@10px": auc10, "epoch": epoch})
            score = -auc5
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "epoch": epoch, "best": min(best, score),
                    "config": {k: str(v) for k, v in vars(args).items()}}
            torch.save(ckpt, args.out / "checkpoint_last.tar")
            if score < best:
                best = score
                torch.save(ckpt, args.out / "checkpoint_best.tar")
            with open(args.out / "val_log.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch, "auc1": auc1, "auc5": auc5, "auc10": auc10}) + "\n")
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
