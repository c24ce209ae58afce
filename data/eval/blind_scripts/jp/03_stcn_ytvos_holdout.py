"""
STCN-style space-time correspondence training on YouTube-VOS 2019 train.
YouTube-VOS val has no public masks, so a few percent of the train videos are held out
for J&F during training.

Launch:
    torchrun --nnodes=1 --nproc_per_node=4 train_stcn.py --yv_root /data/YouTube2019 --run_name stcn_yv
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d

log = logging.getLogger("stcn")

NORM_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
NORM_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--yv_root", required=True)
    parser.add_argument("--run_name", default="stcn_yv")
    parser.add_argument("--holdout_frac", type=float, default=0.03)
    parser.add_argument("--batch_size", type=int, default=4, help="clips per GPU")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--iterations", type=int, default=150000)
    parser.add_argument("--milestone", type=int, default=125000)
    parser.add_argument("--eval_interval", type=int, default=5000)
    parser.add_argument("--save_interval", type=int, default=10000)
    parser.add_argument("--size", type=int, default=384)
    parser.add_argument("--mem_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_videos(meta_path, holdout_frac):
    with open(meta_path) as f:
        videos = sorted(json.load(f)["videos"].keys())
    random.shuffle(videos)
    n_val = max(1, int(len(videos) * holdout_frac))
    return videos[n_val:], videos[:n_val]


def read_rgb(p, size):
    im = np.asarray(Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
    return torch.from_numpy((im - NORM_MEAN) / NORM_STD).permute(2, 0, 1)


def read_mask(p, size):
    return np.asarray(Image.open(p).convert("P").resize((size, size), Image.NEAREST))


class TripletDataset(Dataset):
    def __init__(self, root, videos, size, max_skip=10):
        self.root, self.size, self.max_skip = root, size, max_skip
        self.videos = [v for v in videos if len(os.listdir(os.path.join(root, "JPEGImages", v))) >= 3]
        self.frames = {v: sorted(os.listdir(os.path.join(root, "JPEGImages", v))) for v in self.videos}

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, idx):
        vid = self.videos[idx]
        names = self.frames[vid]
        skip = random.randint(1, self.max_skip)
        start = random.randint(0, max(0, len(names) - 1 - 2 * skip))
        ids = [min(start + k * skip, len(names) - 1) for k in range(3)]
        if random.random() < 0.5:
            ids = ids[::-1]
        imgs = torch.stack([read_rgb(os.path.join(self.root, "JPEGImages", vid, names[i]), self.size) for i in ids])
        masks = np.stack([read_mask(os.path.join(self.root, "Annotations", vid, names[i][:-4] + ".png"), self.size) for i in ids])
        if random.random() < 0.5:
            imgs, masks = imgs.flip(-1), masks[..., ::-1].copy()
        labels = [l for l in np.unique(masks[0]) if l != 0]
        picked = random.sample(labels, min(2, len(labels)))
        cls_gt = np.zeros(masks.shape, dtype=np.int64)
        for k, l in enumerate(picked):
            cls_gt[masks == l] = k + 1
        first = np.stack([masks[0] == l for l in picked] + [np.zeros_like(masks[0], dtype=bool)] * (2 - len(picked)))
        return imgs, torch.from_numpy(cls_gt), torch.from_numpy(first).float(), torch.tensor(len(picked))


def resnet(depth, in_ch=3):
    fn = {18: torchvision.models.resnet18, 50: torchvision.models.resnet50}[depth]
    r = fn(weights="DEFAULT", norm_layer=FrozenBatchNorm2d)
    if in_ch != 3:
        w = r.conv1.weight.data
        r.conv1 = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        r.conv1.weight.data = torch.cat([w, torch.zeros(64, in_ch - 3, 7, 7)], 1)
    return r


class STCN(nn.Module):
    def __init__(self, key_dim=64, value_dim=512):
        super().__init__()
        k = resnet(50)
        self.key_stem = nn.Sequential(k.conv1, k.bn1, k.relu, k.maxpool, k.layer1)
        self.key_l2, self.key_l3 = k.layer2, k.layer3
        v = resnet(18, in_ch=5)
        self.value_body = nn.Sequential(v.conv1, v.bn1, v.relu, v.maxpool, v.layer1, v.layer2, v.layer3)
        self.value_fuse = nn.Conv2d(1024 + 256, value_dim, 3, padding=1)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.compress = nn.Conv2d(1024 + value_dim, 512, 3, padding=1)
        self.up1 = nn.Conv2d(512 + 512, 256, 3, padding=1)
        self.up2 = nn.Conv2d(256 + 256, 256, 3, padding=1)
        self.pred = nn.Conv2d(256, 1, 3, padding=1)

    def encode_key(self, img):
        f4 = self.key_stem(img)
        f8 = self.key_l2(f4)
        f16 = self.key_l3(f8)
        return self.key_proj(f16), f16, f8, f4

    def encode_value(self, img, f16, mask, other):
        v = self.value_body(torch.cat([img, mask[:, None], other[:, None]], 1))
        return self.value_fuse(torch.cat([v, f16], 1))

    def readout(self, qk, mk, mv):
        # mk: B C N, mv: B C N, qk: B C H W
        b, c, h, w = qk.shape
        q = qk.flatten(2)
        sim = (2 * mk.transpose(1, 2) @ q - mk.pow(2).sum(1).unsqueeze(2)) / c ** 0.5
        return (mv @ F.softmax(sim, dim=1)).view(b, -1, h, w)

    def decode(self, f16, f8, f4, mem):
        x = F.relu(self.compress(torch.cat([f16, mem], 1)))
        x = F.relu(self.up1(torch.cat([F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), f8], 1)))
        x = F.relu(self.up2(torch.cat([F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), f4], 1)))
        return F.interpolate(self.pred(x), scale_factor=4, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, imgs, first_masks):
        """imgs: B 3 3 H W (three frames), first_masks: B 2 H W -> logits for frames 1, 2 (B 3 H W each)."""
        B = imgs.shape[0]
        k, f16, f8, f4 = self.encode_key(imgs.flatten(0, 1))
        k, f16, f8, f4 = [x.view(B, 3, *x.shape[1:]) for x in (k, f16, f8, f4)]
        masks = first_masks
        mem_k, mem_v = [k[:, 0]], [[self.encode_value(imgs[:, 0], f16[:, 0], masks[:, o], masks[:, 1 - o]) for o in range(2)]]
        outs = []
        for t in (1, 2):
            mk = torch.stack(mem_k, 2).flatten(2)
            probs = []
            for o in range(2):
                mv = torch.stack([v[o] for v in mem_v], 2).flatten(2)
                probs.append(torch.sigmoid(self.decode(f16[:, t], f8[:, t], f4[:, t], self.readout(k[:, t], mk, mv))))
            prob = torch.stack(probs, 1)
            bg = torch.prod(1 - prob, 1, keepdim=True)
            p = torch.cat([bg, prob], 1).clamp(1e-7, 1 - 1e-7)
            logits = torch.log(p / (1 - p))
            outs.append(logits)
            if t == 1:
                sm = F.softmax(logits, 1)[:, 1:]
                mem_k.append(k[:, 1])
                mem_v.append([self.encode_value(imgs[:, 1], f16[:, 1], sm[:, o], sm[:, 1 - o]) for o in range(2)])
        return outs


@torch.no_grad()
def eval_holdout(net, root, videos, size, mem_every, device, rank, world):
    """Per-sequence J&F over the held-out train videos, reduced over ranks."""
    net.eval()
    totals = torch.zeros(3, device=device)  # sum J, sum F, num sequences
    for vid in videos[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages", vid)))
        ann = sorted(os.listdir(os.path.join(root, "Annotations", vid)))
        gts = np.stack([read_mask(os.path.join(root, "Annotations", vid, a), size) for a in ann])
        labels = [l for l in np.unique(gts[0]) if l != 0][:2]
        if not labels:
            continue
        imgs = torch.stack([read_rgb(os.path.join(root, "JPEGImages", vid, n), size) for n in names]).to(device)
        k, f16, f8, f4 = net.encode_key(imgs)
        cur = torch.stack([torch.from_numpy(gts[0] == l).float() for l in labels] + [torch.zeros(size, size)] * (2 - len(labels))).to(device)
        mem_k = [k[0:1]]
        mem_v = [[net.encode_value(imgs[0:1], f16[0:1], cur[o:o + 1], cur[1 - o:2 - o]) for o in range(2)]]
        preds = {0: gts[0]}
        for t in range(1, len(names)):
            mk = torch.stack(mem_k, 2).flatten(2)
            prob = torch.stack([torch.sigmoid(net.decode(f16[t:t + 1], f8[t:t + 1], f4[t:t + 1],
                                net.readout(k[t:t + 1], mk, torch.stack([v[o] for v in mem_v], 2).flatten(2))))
                                for o in range(2)], 1)[0]
            prob = torch.cat([torch.prod(1 - prob, 0, keepdim=True), prob])
            lab = prob.argmax(0)
            preds[t] = np.zeros((size, size), np.uint8)
            for i, l in enumerate(labels):
                preds[t][(lab == i + 1).cpu().numpy()] = l
            if t % mem_every == 0:
                cur = torch.stack([(lab == o + 1).float() for o in range(2)])
                mem_k.append(k[t:t + 1])
                mem_v.append([net.encode_value(imgs[t:t + 1], f16[t:t + 1], cur[o:o + 1], cur[1 - o:2 - o]) for o in range(2)])
        frame_of = {n[:-4]: i for i, n in enumerate(names)}
        js, fs = [], []
        for a_i, a in enumerate(ann[1:], start=1):
            t = frame_of[a[:-4]]
            for l in labels:
                p, g = preds[t] == l, gts[a_i] == l
                inter, union = (p & g).sum(), (p | g).sum()
                js.append(1.0 if union == 0 else inter / union)
                pb = p ^ (F.max_pool2d(-torch.from_numpy(p).float()[None, None], 3, 1, 1)[0, 0] > -1).numpy()
                gb = g ^ (F.max_pool2d(-torch.from_numpy(g).float()[None, None], 3, 1, 1)[0, 0] > -1).numpy()
                dil = lambda m: F.max_pool2d(torch.from_numpy(m).float()[None, None], 7, 1, 3)[0, 0].bool().numpy()
                prec = (pb & dil(gb)).sum() / max(pb.sum(), 1)
                rec = (gb & dil(pb)).sum() / max(gb.sum(), 1)
                fs.append(1.0 if pb.sum() + gb.sum() == 0 else (0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)))
        if js:
            totals += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device)
    dist.all_reduce(totals)
    net.train()
    n = max(totals[2].item(), 1.0)
    return totals[0].item() / n, totals[1].item() / n


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    seed_everything(args.seed + rank)

    train_videos, val_videos = split_videos(os.path.join(args.yv_root, "train", "meta.json"), args.holdout_frac)
    log.info("train videos: %d, held out: %d", len(train_videos), len(val_videos))
    train_root = os.path.join(args.yv_root, "train")
    dataset = TripletDataset(train_root, train_videos, args.size)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = DistributedDataParallel(STCN().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world / 4, weight_decay=1e-7)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [args.milestone], gamma=0.1)
    writer = SummaryWriter(os.path.join("runs", args.run_name)) if rank == 0 else None
    ckpt_dir = os.path.join("saves", args.run_name)
    os.makedirs(ckpt_dir, exist_ok=True)

    it, epoch, best_jf = 0, 0, 0.0
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for imgs, cls_gt, first, n_obj in loader:
            imgs, cls_gt, first = imgs.to(device, non_blocking=True), cls_gt.to(device), first.to(device)
            outs = model(imgs, first)
            loss = sum(F.cross_entropy(o, cls_gt[:, t]) for t, o in zip((1, 2), outs)) / 2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                writer.add_scalar("loss/train", loss.item(), it)
                log.info("it %d epoch %d loss %.4f", it, epoch, loss.item())
            if it % args.eval_interval == 0:
                j, f = eval_holdout(model.module, train_root, val_videos, args.size, args.mem_every, device, rank, world)
                if rank == 0:
                    writer.add_scalar("val/J", j, it)
                    writer.add_scalar("val/F", f, it)
                    writer.add_scalar("val/JF", (j + f) / 2, it)
                    log.info("it %d holdout J %.4f F %.4f J&F %.4f", it, j, f, (j + f) / 2)
                    if (j + f) / 2 > best_jf:
                        best_jf = (j + f) / 2
                        torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pth"))
            if rank == 0 and it % args.save_interval == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "it": it},
                           os.path.join(ckpt_dir, f"ckpt_{it}.pth"))
            if it >= args.iterations:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "final.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
