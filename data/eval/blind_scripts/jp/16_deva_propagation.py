"""
Class-agnostic temporal propagation module (DEVA-style) trained on VOS data, so that it can later be
combined with any image-level segmenter.

    torchrun --nproc_per_node=4 train_propagation.py --davis ../DAVIS/2017/trainval \
        --youtube ../YouTube/train --burst ../BURST/train --exp prop_s3
"""
import argparse
import datetime
import os
import random
from os import path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d


def get_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--davis", default="../DAVIS/2017/trainval")
    parser.add_argument("--youtube", default="../YouTube/train")
    parser.add_argument("--burst", default="../BURST/train")
    parser.add_argument("--exp", default="prop")
    parser.add_argument("--batch_size", type=int, default=8, help="per GPU")
    parser.add_argument("--num_frames", type=int, default=8)
    parser.add_argument("--num_objects", type=int, default=3)
    parser.add_argument("--size", type=int, default=384)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--iterations", type=int, default=125000)
    parser.add_argument("--save_network_interval", type=int, default=25000)
    parser.add_argument("--eval_interval", type=int, default=12500)
    parser.add_argument("--num_workers", type=int, default=12)
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


IM_MEAN, IM_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def im_tensor(p, size):
    im = Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR)
    return torchvision.transforms.functional.normalize(torchvision.transforms.functional.to_tensor(im), IM_MEAN, IM_STD)


class MultiObjectClips(Dataset):
    def __init__(self, im_root, gt_root, num_frames, num_objects, size, max_jump=10):
        self.im_root, self.gt_root = im_root, gt_root
        self.num_frames, self.num_objects, self.size, self.max_jump = num_frames, num_objects, size, max_jump
        self.videos = []
        for v in sorted(os.listdir(gt_root)):
            frames = sorted(f[:-4] for f in os.listdir(path.join(gt_root, v)))
            if len(frames) >= num_frames:
                self.videos.append((v, frames))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, frames = self.videos[i]
        jump = random.randint(1, self.max_jump)
        span = min(len(frames), jump * (self.num_frames - 1) + 1)
        s = random.randint(0, len(frames) - span)
        ids = sorted(random.sample(range(s, s + span), self.num_frames))
        imgs = torch.stack([im_tensor(path.join(self.im_root, v, frames[k] + ".jpg"), self.size) for k in ids])
        gts = np.stack([np.asarray(Image.open(path.join(self.gt_root, v, frames[k] + ".png")).resize((self.size, self.size), Image.NEAREST)) for k in ids])
        labels = [l for l in np.unique(gts[0]) if l != 0]
        random.shuffle(labels)
        labels = labels[: self.num_objects]
        cls_gt = np.zeros(gts.shape, np.int64)
        for j, l in enumerate(labels, start=1):
            cls_gt[gts == l] = j
        selector = torch.zeros(self.num_objects)
        selector[: len(labels)] = 1
        return imgs, torch.from_numpy(cls_gt), selector


class PropagationNet(nn.Module):
    def __init__(self, num_objects=3, key_dim=64, value_dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.pixel_encoder = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.mask_encoder = nn.Sequential(nn.Conv2d(2, 64, 7, 4, 3), nn.GroupNorm(8, 64), nn.ReLU(), nn.Conv2d(64, 128, 3, 4, 1))
        self.value_fuse = nn.Conv2d(1024 + 128, value_dim, 3, padding=1)
        self.decoder = nn.Sequential(nn.Conv2d(1024 + value_dim, 256, 3, padding=1), nn.GroupNorm(16, 256), nn.ReLU(),
                                     nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                     nn.Conv2d(256, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU(),
                                     nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                     nn.Conv2d(128, 1, 3, padding=1))
        self.num_objects = num_objects

    def encode_frames(self, x):
        f16 = self.pixel_encoder(x)
        return self.key_proj(f16), f16

    def encode_mask(self, f16, masks):
        # masks: B K H W probabilities -> per-object values B K C h w
        B, K = masks.shape[:2]
        others = masks.sum(1, keepdim=True) - masks
        g = self.mask_encoder(torch.stack([masks, others], 2).flatten(0, 1))
        g = F.interpolate(g, size=f16.shape[-2:], mode="bilinear", align_corners=False)
        v = self.value_fuse(torch.cat([f16.repeat_interleave(K, 0), g], 1))
        return v.view(B, K, *v.shape[1:])

    def segment(self, qk, f16, mem_k, mem_v, selector, size):
        B, K = mem_v.shape[:2]
        c = qk.shape[1]
        aff = torch.softmax(torch.einsum("bcn,bcm->bnm", mem_k, qk.flatten(2)) / c ** 0.5, 1)
        read = torch.einsum("bkcn,bnm->bkcm", mem_v, aff).reshape(B * K, -1, *qk.shape[-2:])
        logit = self.decoder(torch.cat([f16.repeat_interleave(K, 0), read], 1))
        logit = F.interpolate(logit, size=size, mode="bilinear", align_corners=False).view(B, K, *size)
        prob = torch.sigmoid(logit) * selector[..., None, None]
        bg = torch.prod(1 - prob, 1, keepdim=True)
        p = torch.cat([bg, prob], 1).clamp(1e-7, 1 - 1e-7)
        return torch.log(p / (1 - p))

    def forward(self, frames, first_onehot, selector):
        B, T = frames.shape[:2]
        k, f16 = self.encode_frames(frames.flatten(0, 1))
        k, f16 = k.unflatten(0, (B, T)), f16.unflatten(0, (B, T))
        mem_k, mem_v = [k[:, 0].flatten(2)], [self.encode_mask(f16[:, 0], first_onehot).flatten(3)]
        out = []
        for t in range(1, T):
            logits = self.segment(k[:, t], f16[:, t], torch.cat(mem_k, 2), torch.cat(mem_v, 3), selector, frames.shape[-2:])
            out.append(logits)
            if t < T - 1:
                mem_k.append(k[:, t].flatten(2))
                mem_v.append(self.encode_mask(f16[:, t], F.softmax(logits, 1)[:, 1:]).flatten(3))
        return torch.stack(out, 1)


def eval_j_f(pred, gt):
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
def evaluate(net, davis_root, size, device):
    """Multi-object propagation on DAVIS-17 val, J&F per sequence, mean over all sequences of all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    val_root = davis_root
    seqs = open(path.join(val_root, "ImageSets/2017/val.txt")).read().split()
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(path.join(val_root, "JPEGImages/480p", seq)))
        imgs = torch.stack([im_tensor(path.join(val_root, "JPEGImages/480p", seq, n), size) for n in names]).to(device)
        gts = np.stack([np.asarray(Image.open(path.join(val_root, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names])
        labels = [l for l in np.unique(gts[0]) if l != 0]
        k, f16 = net.encode_frames(imgs)
        onehot = torch.from_numpy(np.stack([gts[0] == l for l in labels]).astype(np.float32)).to(device)[None]
        sel = torch.ones(1, len(labels), device=device)
        mem_k, mem_v = [k[:1].flatten(2)], [net.encode_mask(f16[:1], onehot).flatten(3)]
        res = []
        for t in range(1, len(names)):
            logits = net.segment(k[t:t + 1], f16[t:t + 1], torch.cat(mem_k, 2), torch.cat(mem_v, 3), sel, (size, size))
            lab = logits.argmax(1)[0].cpu().numpy()
            res += [eval_j_f(lab == j, gts[t] == l) for j, l in enumerate(labels, start=1)]
            if t % 5 == 0:
                mem_k.append(k[t:t + 1].flatten(2))
                mem_v.append(net.encode_mask(f16[t:t + 1], F.softmax(logits, 1)[:, 1:]).flatten(3))
        js, fs = zip(*res)
        total += torch.tensor([np.mean(js), np.mean(fs), 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total[0] / total[2]).item(), (total[1] / total[2]).item()


def main():
    config = get_config()
    torch.cuda.set_device(config.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", config.local_rank)
    torch.manual_seed(14159265)
    random.seed(14159265 + rank)
    np.random.seed(14159265 + rank)
    if rank == 0:
        print(f"world size {world}; config: {vars(config)}", flush=True)

    net = PropagationNet(config.num_objects).to(device)
    model = DDP(net, device_ids=[config.local_rank], output_device=config.local_rank, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr * world / 4, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(config.iterations * 0.8)], 0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=config.amp)

    def clips(im, gt):
        return MultiObjectClips(im, gt, config.num_frames, config.num_objects, config.size)
    train_set = ConcatDataset([
        clips(path.join(config.davis, "JPEGImages/480p"), path.join(config.davis, "Annotations/480p")),
        clips(path.join(config.youtube, "JPEGImages"), path.join(config.youtube, "Annotations")),
        clips(path.join(config.burst, "frames"), path.join(config.burst, "masks")),
    ])
    sampler = DistributedSampler(train_set, rank=rank, num_replicas=world, shuffle=True)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler, num_workers=config.num_workers,
                        pin_memory=True, drop_last=True)
    writer = SummaryWriter(path.join("saves", config.exp)) if rank == 0 else None
    save_dir = path.join("saves", config.exp)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    it, epoch = 0, 0
    while it < config.iterations:
        sampler.set_epoch(epoch)
        model.train()
        for frames, cls_gt, selector in loader:
            frames, cls_gt, selector = frames.to(device, non_blocking=True), cls_gt.to(device, non_blocking=True), selector.to(device)
            first = torch.stack([(cls_gt[:, 0] == j + 1).float() for j in range(config.num_objects)], 1)
            with torch.cuda.amp.autocast(enabled=config.amp):
                logits = model(frames, first, selector)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), cls_gt[:, 1:].flatten(0, 1))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                writer.add_scalar("train/ce", loss.item(), it)
                print(f"{datetime.datetime.now():%H:%M:%S} it {it} ce {loss.item():.4f}", flush=True)
            if it % config.eval_interval == 0:
                model.eval()
                j, f = evaluate(net, config.davis, config.size, device)
                model.train()
                if rank == 0:
                    writer.add_scalar("val/J&F", (j + f) / 2, it)
                    print(f"[val] it {it}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}", flush=True)
            if rank == 0 and it % config.save_network_interval == 0:
                torch.save(net.state_dict(), path.join(save_dir, f"{config.exp}_{it}.pth"))
            if it >= config.iterations:
                break
        epoch += 1

    if rank == 0:
        torch.save(net.state_dict(), path.join(save_dir, f"{config.exp}_final.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
