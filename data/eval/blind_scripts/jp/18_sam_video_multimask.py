"""
SAM-style promptable video segmentation: SAM ViT-B image encoder, prompt encoder and two-way mask decoder
from SAM, plus a memory encoder / memory attention so that the first-frame prompt is propagated.

The first frame is prompted either with the ground-truth mask or with 1-3 clicks; like SAM, a single
click is ambiguous, so the decoder then emits 3 candidate masks and the IoU head picks one.

    torchrun --nproc_per_node=8 train_sam_video.py --data /data/sav_train --davis /data/DAVIS --out exp/sam_video
"""
import argparse
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--davis", required=True)
    p.add_argument("--out", default="exp/sam_video")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--clip_len", type=int, default=8)
    p.add_argument("--p_mask_prompt", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--batch", type=int, default=1, help="clips per GPU")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def rgb(path, size):
    x = torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR))).permute(2, 0, 1).float()
    return (x - torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)) / torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)


def lbl(path, size):
    return np.array(Image.open(path).resize((size, size), Image.NEAREST))


class VideoClips(Dataset):
    def __init__(self, root, clip_len, size):
        self.root, self.clip_len, self.size = root, clip_len, size
        self.videos = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations", v)))
            if len(names) >= clip_len:
                self.videos.append((v, names))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        s = random.randint(0, len(names) - self.clip_len)
        sel = names[s:s + self.clip_len]
        frames = torch.stack([rgb(os.path.join(self.root, "JPEGImages", v, n + ".jpg"), self.size) for n in sel])
        anns = np.stack([lbl(os.path.join(self.root, "Annotations", v, n + ".png"), self.size) for n in sel])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return frames, torch.from_numpy((anns == o).astype(np.float32))


class MLP(nn.Sequential):
    def __init__(self, i, h, o, n=3):
        dims = [i] + [h] * (n - 1)
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        super().__init__(*layers, nn.Linear(dims[-1], o))


class SAMVideo(nn.Module):
    def __init__(self, dim=256, num_multimask=3, n_mem=6):
        super().__init__()
        self.image_encoder = timm.create_model("samvit_base_patch16.sa1b", pretrained=True, img_size=512, num_classes=0)
        # prompt encoder
        self.pe_gaussian = nn.Parameter(torch.randn(2, dim // 2), requires_grad=False)
        self.point_embeddings = nn.Embedding(2, dim)
        self.mask_downscaling = nn.Sequential(nn.Conv2d(1, 16, 4, 4), nn.GELU(), nn.Conv2d(16, dim, 4, 4))
        self.no_mask_embed = nn.Embedding(1, dim)
        # mask decoder
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(1 + num_multimask, dim)
        self.token_attn = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 2048, batch_first=True), 2)
        self.image_attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.upscale = nn.Sequential(nn.ConvTranspose2d(dim, 64, 2, 2), nn.GroupNorm(8, 64), nn.GELU(), nn.ConvTranspose2d(64, 32, 2, 2), nn.GELU())
        self.hypernets = nn.ModuleList([MLP(dim, dim, 32) for _ in range(1 + num_multimask)])
        self.iou_head = MLP(dim, 256, 1 + num_multimask)
        # memory
        self.mem_enc = nn.Sequential(nn.Conv2d(dim + 1, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(), nn.Conv2d(dim, 64, 1))
        self.mem_attn = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, batch_first=True, norm_first=True), 2)
        self.mem_in = nn.Linear(64, dim)
        self.n_mem = n_mem
        self.num_multimask = num_multimask

    def pe(self, coords):
        c = (2 * coords - 1) @ self.pe_gaussian * 2 * math.pi
        return torch.cat([c.sin(), c.cos()], -1)

    def decode(self, img_feat, sparse, multimask):
        B, C, h, w = img_feat.shape
        tokens = torch.cat([self.iou_token.weight, self.mask_tokens.weight], 0)[None].expand(B, -1, -1)
        if sparse is not None:
            tokens = torch.cat([tokens, sparse], 1)
        src = img_feat.flatten(2).transpose(1, 2)
        tokens = self.token_attn(tokens, src)
        src = src + self.image_attn(src, tokens, tokens, need_weights=False)[0]
        up = self.upscale(src.transpose(1, 2).reshape(B, C, h, w))
        idx = list(range(1, 1 + self.num_multimask)) if multimask else [0]
        hyper = torch.stack([self.hypernets[i](tokens[:, 1 + i]) for i in idx], 1)
        masks = (hyper @ up.flatten(2)).view(B, len(idx), *up.shape[-2:])
        iou = self.iou_head(tokens[:, 0])[:, [i for i in idx]]
        return masks, iou

    def forward(self, frames, prompt):
        """frames: B T 3 H W; prompt: ("mask", B H W) or ("points", coords B N 2 in [0,1], labels B N)."""
        B, T, _, H, W = frames.shape
        feats = self.image_encoder.forward_features(frames.flatten(0, 1)).unflatten(0, (B, T))   # B T 256 h w
        kind, *p = prompt
        if kind == "mask":
            dense, sparse, multimask = self.mask_downscaling(p[0][:, None]), None, False
        else:
            coords, labels = p
            sparse = self.pe(coords) + self.point_embeddings(labels)
            dense, multimask = self.no_mask_embed.weight[:, :, None, None], coords.shape[1] == 1
        masks0, iou0 = self.decode(feats[:, 0] + dense, sparse, multimask)
        best = masks0[torch.arange(B), iou0.argmax(1)][:, None]
        bank = [self.mem_in(self.mem_enc(torch.cat([feats[:, 0], F.interpolate(best.sigmoid(), size=feats.shape[-2:], mode="bilinear")], 1))
                            .flatten(2).transpose(1, 2))]
        outs = [(masks0, iou0)]
        for t in range(1, T):
            f = feats[:, t]
            x = self.mem_attn(f.flatten(2).transpose(1, 2), torch.cat(bank[:1] + bank[1:][-(self.n_mem - 1):], 1))
            x = x.transpose(1, 2).reshape_as(f)
            m, iou = self.decode(x, None, False)
            outs.append((m, iou))
            bank.append(self.mem_in(self.mem_enc(torch.cat([x, F.interpolate(m.sigmoid(), size=f.shape[-2:], mode="bilinear")], 1))
                                    .flatten(2).transpose(1, 2)))
        return outs


def sample_clicks(mask, n):
    ys, xs = torch.nonzero(mask, as_tuple=True)
    k = torch.randint(len(ys), (n,), device=mask.device)
    return torch.stack([xs[k], ys[k]], -1).float() / mask.shape[-1]


def seg_loss(logits, gt):
    gt = F.interpolate(gt, size=logits.shape[-2:], mode="bilinear") > 0.5
    gt = gt.float()
    p = logits.sigmoid()
    focal = (F.binary_cross_entropy_with_logits(logits, gt, reduction="none") * (1 - (p * gt + (1 - p) * (1 - gt))) ** 2).flatten(2).mean(-1)
    dice = 1 - (2 * (p * gt).flatten(2).sum(-1) + 1) / (p.flatten(2).sum(-1) + gt.flatten(2).sum(-1) + 1)
    iou = ((p > 0.5).float() * gt).flatten(2).sum(-1) / (((p > 0.5).float() + gt).clamp(max=1).flatten(2).sum(-1) + 1e-6)
    return 20 * focal + dice, iou


def jf(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    if not e.any():
        return j, 1.0
    pr = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    rc = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if pr + rc == 0 else 2 * pr * rc / (pr + rc)


@torch.no_grad()
def evaluate(net, root, size, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    seqs = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", seq)))
        frames = torch.stack([rgb(os.path.join(root, "JPEGImages/480p", seq, n), size) for n in names]).to(device)[None]
        gts = np.stack([lbl(os.path.join(root, "Annotations/480p", seq, n[:-4] + ".png"), size) for n in names])
        res = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = net(frames, ("mask", m0))
            for t in range(1, len(names)):
                m = F.interpolate(outs[t][0][:, :1].float(), size=(size, size), mode="bilinear")[0, 0] > 0
                res.append(jf(m.cpu().numpy(), gts[t] == o))
        js, fs = zip(*res)
        acc += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    net = SAMVideo().to(device)
    model = DDP(net, device_ids=[local_rank])
    enc = [p for n, p in net.named_parameters() if n.startswith("image_encoder.") and p.requires_grad]
    rest = [p for n, p in net.named_parameters() if not n.startswith("image_encoder.") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": enc, "lr": args.lr * 0.1}, {"params": rest}], lr=args.lr, weight_decay=0.1)

    ds = VideoClips(args.data, args.clip_len, args.size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for frames, masks in loader:
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            if random.random() < args.p_mask_prompt or not masks[:, 0].flatten(1).any(1).all():
                prompt = ("mask", masks[:, 0])
            else:
                n = random.randint(1, 3)
                coords = torch.stack([sample_clicks(m, n) for m in masks[:, 0]])
                prompt = ("points", coords, torch.ones(coords.shape[:2], dtype=torch.long, device=device))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = model(frames, prompt)
            loss = 0.0
            for t, (m, iou_pred) in enumerate(outs):
                per_mask, iou_true = seg_loss(m.float(), masks[:, t:t + 1].expand(-1, m.shape[1], -1, -1))
                best = per_mask.argmin(1)
                ar = torch.arange(m.shape[0], device=device)
                loss = loss + per_mask[ar, best].mean() + F.mse_loss(iou_pred.float()[ar, best], iou_true[ar, best])
            loss = loss / len(outs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/sec_per_it", (time.time() - tic) / 20, step)
                tic = time.time()

        model.eval()
        j, f = evaluate(net, args.davis, args.size, device)
        if rank == 0:
            writer.add_scalar("val/J&F", (j + f) / 2, epoch)
            print(f"epoch {epoch}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
