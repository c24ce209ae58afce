"""
Frozen DINOv2-S/14 features + trainable memory readout and mask decoder for semi-supervised VOS.
Multi-GPU via Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train_frozen_dino.py \
        --train_root /data/ytvos19/train --davis /data/DAVIS --output_dir runs/frozen_dino
"""
import argparse
import math
import os
import random

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_root", required=True)
    p.add_argument("--davis", required=True)
    p.add_argument("--output_dir", default="runs/frozen_dino")
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--clip_len", type=int, default=6)
    p.add_argument("--per_device_batch", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def load_rgb(path, size):
    x = torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR))).permute(2, 0, 1).float() / 255
    return (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def load_lbl(path, size):
    return np.array(Image.open(path).resize((size, size), Image.NEAREST))


class TrainClips(Dataset):
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
        if random.random() < 0.5:
            sel = sel[::-1]
        frames = torch.stack([load_rgb(os.path.join(self.root, "JPEGImages", v, n + ".jpg"), self.size) for n in sel])
        lbl = np.stack([load_lbl(os.path.join(self.root, "Annotations", v, n + ".png"), self.size) for n in sel])
        objs = [o for o in np.unique(lbl[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return frames, torch.from_numpy((lbl == o).astype(np.float32))


class DavisVal(Dataset):
    """One item per sequence (all frames); lengths differ, so batch size is 1."""

    def __init__(self, root, size):
        self.root, self.size = root, size
        self.seqs = sorted(open(os.path.join(root, "ImageSets/2017/val.txt")).read().split())

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i]
        names = sorted(os.listdir(os.path.join(self.root, "JPEGImages/480p", seq)))
        frames = torch.stack([load_rgb(os.path.join(self.root, "JPEGImages/480p", seq, n), self.size) for n in names])
        lbl = np.stack([load_lbl(os.path.join(self.root, "Annotations/480p", seq, n[:-4] + ".png"), self.size) for n in names])
        return frames, torch.from_numpy(lbl.astype(np.int64)), i


class FrozenDinoVOS(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.dino = timm.create_model("vit_small_patch14_dinov2.lvd142m", pretrained=True, num_classes=0, dynamic_img_size=True)
        self.dino.requires_grad_(False)
        self.key = nn.Linear(384, 64)
        self.value = nn.Linear(384 + 1, dim)
        self.fuse = nn.TransformerEncoderLayer(384 + dim, 8, 1024, batch_first=True, norm_first=True)
        self.head = nn.Sequential(nn.Conv2d(384 + dim, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.GELU(),
                                  nn.ConvTranspose2d(128, 64, 2, 2), nn.GroupNorm(8, 64), nn.GELU(), nn.Conv2d(64, 1, 1))

    @torch.no_grad()
    def features(self, x):
        self.dino.eval()
        return self.dino.forward_features(x)[:, self.dino.num_prefix_tokens:]

    def value_of(self, f, mask, hw):
        m = F.adaptive_avg_pool2d(mask[:, None], hw).flatten(2).transpose(1, 2)
        return self.value(torch.cat([f, m], -1))

    def step(self, f, mem_k, mem_v, hw, out_hw):
        q = self.key(f)
        aff = torch.softmax(q @ mem_k.transpose(1, 2) / 8.0, -1)
        x = self.fuse(torch.cat([f, aff @ mem_v], -1))
        x = x.transpose(1, 2).reshape(f.shape[0], -1, *hw)
        return F.interpolate(self.head(x), size=out_hw, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, frames, mask0):
        B, T, _, H, W = frames.shape
        hw = (H // 14, W // 14)
        f = self.features(frames.flatten(0, 1)).unflatten(0, (B, T))
        mk, mv = [self.key(f[:, 0])], [self.value_of(f[:, 0], mask0, hw)]
        outs = []
        for t in range(1, T):
            lg = self.step(f[:, t], torch.cat(mk, 1), torch.cat(mv, 1), hw, (H, W))
            outs.append(lg)
            mk.append(self.key(f[:, t]))
            mv.append(self.value_of(f[:, t], torch.sigmoid(lg), hw))
        return torch.stack(outs, 1)


def j_and_f(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 7, 1, 3) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def evaluate(accelerator, model, val_loader, size):
    net = accelerator.unwrap_model(model)
    net.eval()
    rows = []
    for frames, lbl, idx in val_loader:
        frames, lbl = frames[0], lbl[0].cpu().numpy()
        hw = (size // 14, size // 14)
        f = net.features(frames)
        scores = []
        for o in [o for o in np.unique(lbl[0]) if o != 0]:
            m0 = torch.from_numpy((lbl[0] == o).astype(np.float32)).to(frames.device)[None]
            mk, mv = [net.key(f[:1])], [net.value_of(f[:1], m0, hw)]
            for t in range(1, len(frames)):
                lg = net.step(f[t:t + 1], torch.cat(mk, 1), torch.cat(mv, 1), hw, (size, size))
                scores.append(j_and_f((lg[0] > 0).cpu().numpy(), lbl[t] == o))
                if t % 5 == 0:
                    mk.append(net.key(f[t:t + 1]))
                    mv.append(net.value_of(f[t:t + 1], torch.sigmoid(lg), hw))
        js, fs = zip(*scores)
        row = torch.tensor([[float(idx), np.mean(js), np.mean(fs)]], device=frames.device)
        # drops the samples the sampler repeated to even out the last batch
        rows.append(accelerator.gather_for_metrics(row))
    net.train()
    allrows = torch.cat(rows)
    return allrows[:, 1].mean().item(), allrows[:, 2].mean().item()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed, device_specific=True)

    model = FrozenDinoVOS()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr * accelerator.num_processes * args.per_device_batch * args.grad_accum / 64,
                            weight_decay=0.05)
    train_loader = DataLoader(TrainClips(args.train_root, args.clip_len, args.size), batch_size=args.per_device_batch,
                              shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(DavisVal(args.davis, args.size), batch_size=1, shuffle=False, num_workers=4)
    steps_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / args.grad_accum)
    # the prepared scheduler advances num_processes steps per optimizer update
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], pct_start=0.05,
                                                total_steps=(args.epochs * steps_per_epoch + 1) * accelerator.num_processes)
    model, opt, train_loader, val_loader, sched = accelerator.prepare(model, opt, train_loader, val_loader, sched)
    accelerator.init_trackers("frozen_dino_vos", config=vars(args))

    start_epoch = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start_epoch = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1]) + 1

    best, global_step = 0.0, start_epoch * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for frames, masks in train_loader:
            with accelerator.accumulate(model):
                logits = model(frames, masks[:, 0])
                tgt = masks[:, 1:]
                prob = torch.sigmoid(logits.float())
                loss = F.binary_cross_entropy_with_logits(logits.float(), tgt) + \
                    (1 - (2 * (prob * tgt).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + tgt.flatten(2).sum(-1) + 1)).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 20 == 0:
                    accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item(),
                                     "train/lr": sched.get_last_lr()[0]}, step=global_step)

        j, f = evaluate(accelerator, model, val_loader, args.size)
        accelerator.log({"val/J": j, "val/F": f, "val/J&F": (j + f) / 2}, step=global_step)
        accelerator.print(f"epoch {epoch}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}")
        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if (j + f) / 2 > best:
            best = (j + f) / 2
            if accelerator.is_main_process:
                torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "best_model.pth"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
