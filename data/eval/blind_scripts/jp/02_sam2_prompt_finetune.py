# Fine-tune a SAM2-like streaming segmenter on MOSE / DAVIS clips with mixed prompt types.
#
#   torchrun --standalone --nproc_per_node=8 finetune_sam2_prompts.py \
#       --train_root data/MOSE/train --val_root data/DAVIS/2017/trainval --out runs/sam2_mix
import argparse
import contextlib
import json
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from scipy.ndimage import binary_dilation, binary_erosion
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_root", required=True)
    ap.add_argument("--val_root", required=True)
    ap.add_argument("--out", default="runs/sam2_mix")
    ap.add_argument("--init", default="checkpoints/sam2_small_converted.pt")
    ap.add_argument("--img_size", type=int, default=512)
    ap.add_argument("--min_frames", type=int, default=4)
    ap.add_argument("--max_frames", type=int, default=10)
    ap.add_argument("--num_maskmem", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base_lr", type=float, default=5e-6, help="lr for 8 GPUs x accum 2; scaled linearly")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--eval_every", type=int, default=2)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb_project", default="vos-sam2")
    return ap.parse_args()


def load_frame(p, size):
    im = Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR)
    return (torch.from_numpy(np.asarray(im)).permute(2, 0, 1).float() / 255 - MEAN) / STD


def load_mask(p, size):
    return np.asarray(Image.open(p).resize((size, size), Image.NEAREST))


class ClipDataset(Dataset):
    """One object per sample; clip length is drawn per sample."""

    def __init__(self, root, size, min_frames, max_frames):
        self.root, self.size = root, size
        self.min_frames, self.max_frames = min_frames, max_frames
        with open(os.path.join(root, "meta.json")) as f:
            meta = json.load(f)["videos"]
        self.items = []
        for vid, v in sorted(meta.items()):
            for obj_id in sorted(v["objects"], key=int):
                if len(v["objects"][obj_id]["frames"]) >= min_frames:
                    self.items.append((vid, int(obj_id), v["objects"][obj_id]["frames"]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, obj, frames = self.items[i]
        t = random.randint(self.min_frames, min(self.max_frames, len(frames)))
        start = random.randint(0, len(frames) - t)
        step = random.choice([1, 2]) if start + 2 * t <= len(frames) else 1
        names = frames[start:start + step * t:step][:t]
        imgs = torch.stack([load_frame(os.path.join(self.root, "JPEGImages", vid, n + ".jpg"), self.size) for n in names])
        masks = np.stack([load_mask(os.path.join(self.root, "Annotations", vid, n + ".png"), self.size) == obj for n in names])
        return imgs, torch.from_numpy(masks).float()


class MiniSAM2(nn.Module):
    def __init__(self, dim=256, num_maskmem=7):
        super().__init__()
        self.num_maskmem = num_maskmem
        self.image_encoder = timm.create_model("vit_small_patch16_224.augreg_in21k", pretrained=True,
                                               num_classes=0, dynamic_img_size=True)
        self.neck = nn.Conv2d(self.image_encoder.embed_dim, dim, 1)
        # prompt encoder
        self.point_embed = nn.Embedding(2, dim)
        self.box_embed = nn.Embedding(2, dim)
        self.pe_proj = nn.Linear(2, dim)
        self.mask_down = nn.Sequential(nn.Conv2d(1, 16, 4, 4), nn.GELU(), nn.Conv2d(16, dim, 4, 4))
        self.no_mem_embed = nn.Parameter(torch.zeros(1, 1, dim))
        self.maskmem_tpos = nn.Parameter(torch.zeros(num_maskmem, 1, 1, dim))
        # memory attention / encoder
        self.mem_attn = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, batch_first=True, norm_first=True), 4)
        self.mem_enc = nn.Sequential(nn.Conv2d(dim + 1, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(), nn.Conv2d(dim, 64, 1))
        self.mem_up = nn.Linear(64, dim)
        # mask decoder
        self.prompt_attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.head = nn.Sequential(nn.ConvTranspose2d(dim, 64, 2, 2), nn.GroupNorm(8, 64), nn.GELU(),
                                  nn.ConvTranspose2d(64, 32, 2, 2), nn.GELU(), nn.Conv2d(32, 1, 1))

    def image_features(self, img):
        x = self.image_encoder.forward_features(img)[:, self.image_encoder.num_prefix_tokens:]
        h = w = img.shape[-1] // 16
        return self.neck(x.transpose(1, 2).reshape(x.shape[0], -1, h, w))

    def encode_prompt(self, kind, prompt, size):
        if kind == "mask":
            return self.mask_down(prompt[:, None]).flatten(2).transpose(1, 2)
        if kind == "box":
            return self.pe_proj(prompt.view(-1, 2, 2) / size) + self.box_embed.weight[None]
        pts, lbl = prompt
        return self.pe_proj(pts / size) + self.point_embed(lbl)

    def decode(self, feat, tokens=None):
        b, c, h, w = feat.shape
        x = feat.flatten(2).transpose(1, 2)
        if tokens is not None:
            x = x + self.prompt_attn(x, tokens, tokens)[0]
        return self.head(x.transpose(1, 2).reshape(b, c, h, w))[:, 0], x.transpose(1, 2).reshape(b, c, h, w)

    def forward(self, frames, prompt_kind, prompt):
        feats = self.image_features(frames)   # T x C x h x w (one clip)
        memory, logits = [], []
        for t in range(frames.shape[0]):
            f = feats[t:t + 1]
            tok = f.flatten(2).transpose(1, 2)
            if t == 0:
                cond = self.mem_attn(tok, self.no_mem_embed.expand(1, 1, -1))
                out, pix = self.decode(cond.transpose(1, 2).reshape_as(f), self.encode_prompt(prompt_kind, prompt, frames.shape[-1]))
            else:
                mem = torch.cat([m + self.maskmem_tpos[min(t - 1 - i, self.num_maskmem - 1)].flatten(1)
                                 for i, m in enumerate(memory)], 1)
                cond = self.mem_attn(tok, mem)
                out, pix = self.decode(cond.transpose(1, 2).reshape_as(f))
            logits.append(out)
            m = torch.sigmoid(F.interpolate(out[:, None], size=f.shape[-2:], mode="bilinear", align_corners=False))
            memory.append(self.mem_up(self.mem_enc(torch.cat([pix, m], 1)).flatten(2).transpose(1, 2)))
            memory = memory[-self.num_maskmem:]
        return torch.cat(logits)


def sample_prompt(mask0, kind):
    if kind == "mask":
        return mask0[None]
    ys, xs = torch.nonzero(mask0, as_tuple=True)
    if kind == "box":
        return torch.stack([xs.min(), ys.min(), xs.max(), ys.max()]).float()[None].to(mask0.device)
    k = torch.randint(len(xs), (3,))
    return torch.stack([xs[k], ys[k]], -1).float()[None], torch.ones(1, 3, dtype=torch.long, device=mask0.device)


def seg_loss(logits, gt):
    gt = F.interpolate(gt[:, None], size=logits.shape[-2:], mode="nearest")[:, 0]
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none")
    focal = (ce * ((1 - (p * gt + (1 - p) * (1 - gt))) ** 2)).mean()
    dice = 1 - (2 * (p * gt).flatten(1).sum(1) + 1) / (p.flatten(1).sum(1) + gt.flatten(1).sum(1) + 1)
    return 20 * focal + dice.mean()


def j_and_f(pred, gt):
    inter, union = np.logical_and(pred, gt).sum(), np.logical_or(pred, gt).sum()
    j = 1.0 if union == 0 else inter / union
    r = max(1, round(0.008 * np.hypot(*gt.shape)))
    pb, gb = pred ^ binary_erosion(pred), gt ^ binary_erosion(gt)
    if pb.sum() == 0 and gb.sum() == 0:
        return j, 1.0
    prec = (pb & binary_dilation(gb, iterations=r)).sum() / max(pb.sum(), 1)
    rec = (gb & binary_dilation(pb, iterations=r)).sum() / max(gb.sum(), 1)
    return j, 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


@torch.inference_mode()
def evaluate(net, root, size, device, rank, world):
    with open(os.path.join(root, "ImageSets", "2017", "val.txt")) as f:
        seqs = sorted(l.strip() for l in f if l.strip())
    results = []
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages", "480p", seq)))
        frames = torch.stack([load_frame(os.path.join(root, "JPEGImages", "480p", seq, n), size) for n in names]).to(device)
        gts = np.stack([load_mask(os.path.join(root, "Annotations", "480p", seq, n[:-4] + ".png"), size) for n in names])
        for obj in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy(gts[0] == obj).float().to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(frames, "mask", m0[None])
            pred = F.interpolate(logits[:, None].float(), size=(size, size), mode="bilinear")[:, 0] > 0
            pred = pred.cpu().numpy()
            js, fs = zip(*[j_and_f(pred[t], gts[t] == obj) for t in range(1, len(names))])
            results.append((f"{seq}_{obj}", float(np.mean(js)), float(np.mean(fs))))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    allres = [r for part in gathered for r in part]
    return float(np.mean([(j + f) / 2 for _, j, f in allres])), len(allres)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    net = MiniSAM2(num_maskmem=args.num_maskmem)
    if args.init and os.path.isfile(args.init):
        missing, unexpected = net.load_state_dict(torch.load(args.init, map_location="cpu"), strict=False)
        if rank == 0:
            print(f"init from {args.init}: {len(missing)} missing, {len(unexpected)} unexpected")
    net.to(device)

    lr = args.base_lr * world * args.accum / 16
    optim = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    # the prompt type is drawn per step, so point/box/mask branches are idle on some steps
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    ds = ClipDataset(args.train_root, args.img_size, args.min_frames, args.max_frames)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=args.workers, pin_memory=True, persistent_workers=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=args.epochs * (len(dl) // args.accum) + 1,
                                                pct_start=0.05)
    if args.resume:
        sched.load_state_dict(ck["sched"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (frames, masks) in enumerate(dl):
            frames, masks = frames[0].to(device, non_blocking=True), masks[0].to(device, non_blocking=True)
            kind = random.choice(["mask", "point", "box"]) if masks[0].any() else "mask"
            prompt = sample_prompt(masks[0], kind)
            sync = (step + 1) % args.accum == 0
            with (contextlib.nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(frames, kind, prompt)
                    loss = seg_loss(logits.float(), masks) / args.accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                optim.step()
                optim.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and step % 50 == 0:
                wandb.log({"loss": loss.item() * args.accum, "lr": sched.get_last_lr()[0], "frames": frames.shape[0]})
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s")

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            model.eval()
            jf, n = evaluate(model.module, args.val_root, args.img_size, device, rank, world)
            if rank == 0:
                wandb.log({"val/J&F": jf, "epoch": epoch})
                print(f"epoch {epoch}: J&F {jf:.4f} over {n} objects")
                ck = {"model": model.module.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                      "epoch": epoch, "best": max(best, jf)}
                torch.save(ck, os.path.join(args.out, "last.pt"))
                if jf > best:
                    torch.save(ck, os.path.join(args.out, "best.pt"))
            best = max(best, jf)
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
