"""STCN main training (static-image pretrained weights -> YouTube-VOS/DAVIS main training).

    torchrun --nproc_per_node=4 03_stcn_main_training.py --id s03 --load_network saves/stcn_s0.pth --stage 3
"""
import argparse
import datetime
import math
import os
import random
from os import path

import numpy as np
import torch
import torch.distributed as distributed
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models
from torchvision.ops import FrozenBatchNorm2d

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

parser = argparse.ArgumentParser()
parser.add_argument("--id", default="NULL")
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--yv_root", default="../YouTube")
parser.add_argument("--davis_root", default="../DAVIS/2017")
parser.add_argument("--load_network", default=None)
parser.add_argument("--load_model", default=None, help="full training state to resume")
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--iterations", type=int, default=150000)
parser.add_argument("--steps", type=int, nargs="*", default=[125000])
parser.add_argument("--lr", type=float, default=2e-5)
parser.add_argument("--gamma", type=float, default=0.1)
parser.add_argument("--num_frames", type=int, default=3)
parser.add_argument("--max_objects", type=int, default=2)
parser.add_argument("--max_skip", type=int, default=20)
parser.add_argument("--save_every", type=int, default=25000)
parser.add_argument("--report_every", type=int, default=100)
parser.add_argument("--eval_every", type=int, default=10000)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--local_rank", type=int, default=0)
para = vars(parser.parse_args())


class VOSTrainDataset(Dataset):
    def __init__(self, im_root, gt_root, max_jump, num_frames, max_objects, size=384, subset=None):
        self.im_root, self.gt_root = im_root, gt_root
        self.max_jump, self.num_frames, self.max_objects, self.size = max_jump, num_frames, max_objects, size
        self.videos, self.frames = [], {}
        for vid in sorted(os.listdir(im_root)):
            if subset is not None and vid not in subset:
                continue
            frames = sorted(os.listdir(path.join(im_root, vid)))
            if len(frames) >= num_frames:
                self.videos.append(vid)
                self.frames[vid] = frames

    def __len__(self):
        return len(self.videos)

    def _crop(self, im, gt, box, flip):
        x0, y0, s, nw, nh = box
        im = im.resize((nw, nh), Image.BICUBIC).crop((x0, y0, x0 + s, y0 + s))
        gt = gt.resize((nw, nh), Image.NEAREST).crop((x0, y0, x0 + s, y0 + s))
        im, gt = np.asarray(im, dtype=np.float32) / 255.0, np.asarray(gt, dtype=np.uint8)
        if flip:
            im, gt = im[:, ::-1], gt[:, ::-1]
        return im, gt

    def __getitem__(self, idx):
        video = self.videos[idx]
        frames = self.frames[video]
        for _ in range(5):
            n = len(frames)
            jump = min(n - 1, self.max_jump)
            idxs = [random.randint(0, n - 1)]
            while len(idxs) < self.num_frames:
                lo, hi = max(0, idxs[-1] - jump), min(n - 1, idxs[-1] + jump)
                cand = [i for i in range(lo, hi + 1) if i not in idxs]
                idxs.append(random.choice(cand) if cand else random.randint(0, n - 1))
            if random.random() < 0.5:
                idxs = idxs[::-1]
            w, h = Image.open(path.join(self.im_root, video, frames[idxs[0]])).size
            scale = self.size / min(w, h) * random.uniform(1.0, 1.4)
            nw, nh = max(self.size, int(w * scale)), max(self.size, int(h * scale))
            box = (random.randint(0, nw - self.size), random.randint(0, nh - self.size), self.size, nw, nh)
            flip = random.random() < 0.5
            ims, gts = [], []
            for i in idxs:
                name = frames[i]
                im = Image.open(path.join(self.im_root, video, name)).convert("RGB")
                gt = Image.open(path.join(self.gt_root, video, name[:-4] + ".png")).convert("P")
                im, gt = self._crop(im, gt, box, flip)
                ims.append(im)
                gts.append(gt)
            labels = [l for l in np.unique(gts[0]) if l != 0]
            if labels:
                break
        labels = random.sample(labels, min(len(labels), self.max_objects))
        ims = torch.from_numpy(np.stack(ims).copy()).permute(0, 3, 1, 2)
        ims = (ims - MEAN) / STD
        gts = np.stack(gts)
        masks = np.zeros((self.num_frames, self.max_objects, self.size, self.size), dtype=np.float32)
        selector = np.zeros(self.max_objects, dtype=np.float32)
        for k, l in enumerate(labels):
            masks[:, k] = gts == l
            selector[k] = 1
        return {"rgb": ims, "gt": torch.from_numpy(masks), "selector": torch.from_numpy(selector), "info": video}


def resnet(depth, extra_chan=0):
    net = getattr(models, f"resnet{depth}")(weights="DEFAULT", norm_layer=FrozenBatchNorm2d)
    if extra_chan:
        w = net.conv1.weight.data
        net.conv1 = nn.Conv2d(3 + extra_chan, 64, 7, 2, 3, bias=False)
        net.conv1.weight.data = torch.cat([w, torch.zeros(64, extra_chan, 7, 7)], 1)
    return net


class ResBlock(nn.Module):
    def __init__(self, indim, outdim):
        super().__init__()
        self.downsample = nn.Conv2d(indim, outdim, 3, padding=1) if indim != outdim else None
        self.conv1 = nn.Conv2d(indim, outdim, 3, padding=1)
        self.conv2 = nn.Conv2d(outdim, outdim, 3, padding=1)

    def forward(self, x):
        r = self.conv2(F.relu(self.conv1(F.relu(x))))
        return (self.downsample(x) if self.downsample is not None else x) + r


class UpsampleBlock(nn.Module):
    def __init__(self, skip_c, up_c, out_c):
        super().__init__()
        self.skip_conv = nn.Conv2d(skip_c, up_c, 3, padding=1)
        self.out_conv = ResBlock(up_c, out_c)

    def forward(self, skip_f, up_f):
        return self.out_conv(self.skip_conv(skip_f) + F.interpolate(up_f, scale_factor=2, mode="bilinear", align_corners=False))


class STCN(nn.Module):
    def __init__(self):
        super().__init__()
        r50 = resnet(50)
        self.key_stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool)
        self.key_layers = nn.ModuleList([r50.layer1, r50.layer2, r50.layer3])
        self.key_proj = nn.Conv2d(1024, 64, 3, padding=1)
        self.key_comp = nn.Conv2d(1024, 512, 3, padding=1)
        r18 = resnet(18, extra_chan=2)
        self.value_trunk = nn.Sequential(r18.conv1, r18.bn1, r18.relu, r18.maxpool, r18.layer1, r18.layer2, r18.layer3)
        self.value_fuser = nn.Sequential(ResBlock(1024 + 256, 512), ResBlock(512, 512))
        self.compress = ResBlock(1024, 512)
        self.up_16_8 = UpsampleBlock(512, 512, 256)
        self.up_8_4 = UpsampleBlock(256, 256, 256)
        self.pred = nn.Conv2d(256, 1, 3, padding=1)
        nn.init.orthogonal_(self.key_proj.weight)
        nn.init.zeros_(self.key_proj.bias)

    def encode_key(self, frame):
        x = self.key_stem(frame)
        f4 = self.key_layers[0](x)
        f8 = self.key_layers[1](f4)
        f16 = self.key_layers[2](f8)
        return self.key_proj(f16), self.key_comp(f16), f16, f8, f4

    def encode_value(self, frame, kf16, mask, other_mask):
        x = self.value_trunk(torch.cat([frame, mask, other_mask], 1))
        return self.value_fuser(torch.cat([x, kf16], 1))

    def segment(self, qk16, qv16, qf8, qf4, mk16, mv16, selector):
        # mk16: B,CK,T,H,W ; mv16: B,K,CV,T,H,W
        B, CK = mk16.shape[:2]
        K = mv16.shape[1]
        mk = mk16.flatten(2)
        qk = qk16.flatten(2)
        affinity = (2 * mk.transpose(1, 2) @ qk - mk.pow(2).sum(1).unsqueeze(2)) / math.sqrt(CK)
        affinity = F.softmax(affinity, dim=1)
        logits = []
        for k in range(K):
            mem = (mv16[:, k].flatten(2) @ affinity).view(B, -1, *qk16.shape[-2:])
            x = self.compress(torch.cat([mem, qv16], 1))
            x = self.up_8_4(qf4, self.up_16_8(qf8, x))
            logits.append(F.interpolate(self.pred(F.relu(x)), scale_factor=4, mode="bilinear", align_corners=False))
        prob = torch.sigmoid(torch.cat(logits, 1)) * selector[:, :, None, None]
        prob = torch.cat([torch.prod(1 - prob, dim=1, keepdim=True), prob], 1).clamp(1e-7, 1 - 1e-7)
        logits = torch.log(prob / (1 - prob))
        return logits, F.softmax(logits, dim=1)[:, 1:]

    def forward(self, mode, *args, **kwargs):
        return getattr(self, mode)(*args, **kwargs)


def run_clip(model, data):
    Fs, Ms, sel = data["rgb"], data["gt"], data["selector"]
    B, T, K = Fs.shape[0], Fs.shape[1], Ms.shape[2]
    k16, kf16_thin, kf16, kf8, kf4 = model("encode_key", Fs.flatten(0, 1))
    unflat = lambda x: x.view(B, T, *x.shape[1:])
    k16, kf16_thin, kf16, kf8, kf4 = map(unflat, (k16, kf16_thin, kf16, kf8, kf4))
    prev_mask = Ms[:, 0]
    mem_k, mem_v, out = [], [], []
    for t in range(1, T):
        others = prev_mask.sum(1, keepdim=True) - prev_mask
        v = torch.stack([model("encode_value", Fs[:, t - 1], kf16[:, t - 1], prev_mask[:, k:k + 1], others[:, k:k + 1])
                         for k in range(K)], 1)
        mem_k.append(k16[:, t - 1])
        mem_v.append(v)
        logits, prev_mask = model("segment", k16[:, t], kf16_thin[:, t], kf8[:, t], kf4[:, t],
                                  torch.stack(mem_k, 2), torch.stack(mem_v, 3), sel)
        out.append(logits)
    return out


def compute_loss(out, data, it):
    Ms, sel = data["gt"], data["selector"]
    total, losses = 0, {}
    for t, logits in enumerate(out, start=1):
        labels = torch.cat([torch.full_like(Ms[:, t, :1], 0.5), Ms[:, t]], 1).argmax(1)
        raw = F.cross_entropy(logits, labels, reduction="none").flatten(1)
        # bootstrapped CE: hard-pixel ratio anneals from 100% to 15% over the first 20k iterations
        p = 1.0 if it < 2000 else max(0.15, 1.0 - 0.85 * (it - 2000) / 18000)
        top = raw.topk(int(raw.shape[1] * p), dim=1).values.mean()
        losses[f"ce_{t}"] = top
        total = total + top
    losses["total"] = total
    return losses


@torch.no_grad()
def evaluate(net, davis_root, rank, world_size, mem_every=5):
    """DAVIS-2017 val, full-length videos, split over ranks. Returns mean J over objects."""
    videos = sorted(open(path.join(davis_root, "ImageSets", "2017", "val.txt")).read().split())
    stats = torch.zeros(2, device="cuda")
    net.eval()
    for vid in videos[rank::world_size]:
        im_dir, gt_dir = path.join(davis_root, "JPEGImages", "480p", vid), path.join(davis_root, "Annotations", "480p", vid)
        names = sorted(os.listdir(im_dir))
        rgb = torch.stack([(torch.from_numpy(np.asarray(Image.open(path.join(im_dir, n)).convert("RGB"), dtype=np.float32)
                                             / 255.0).permute(2, 0, 1) - MEAN) / STD for n in names]).cuda()
        gt = torch.stack([torch.from_numpy(np.asarray(Image.open(path.join(gt_dir, n[:-4] + ".png")), dtype=np.int64))
                          for n in names]).cuda()
        H, W = rgb.shape[-2:]
        ph, pw = (-H) % 16, (-W) % 16
        rgb = F.pad(rgb, (0, pw, 0, ph), mode="reflect")
        K = int(gt[0].max())
        sel = torch.ones(1, K, device="cuda")
        prob = F.pad(torch.stack([(gt[0] == k + 1).float() for k in range(K)])[None], (0, pw, 0, ph))
        mem_k, mem_v, pred = [], [], [gt[0]]
        for t in range(len(names)):
            k16, kf16_thin, kf16, kf8, kf4 = net.encode_key(rgb[t:t + 1])
            if t > 0:
                _, prob = net.segment(k16, kf16_thin, kf8, kf4, torch.stack(mem_k, 2), torch.stack(mem_v, 3), sel)
                pred.append(torch.cat([1 - prob.sum(1, keepdim=True), prob], 1).argmax(1)[0, :H, :W])
            if t % mem_every == 0:
                others = prob.sum(1, keepdim=True) - prob
                mem_k.append(k16)
                mem_v.append(torch.stack([net.encode_value(rgb[t:t + 1], kf16, prob[:, k:k + 1], others[:, k:k + 1])
                                          for k in range(K)], 1))
        pred = torch.stack(pred)
        for k in range(1, K + 1):
            inter = ((pred[1:-1] == k) & (gt[1:-1] == k)).flatten(1).sum(1).float()
            union = ((pred[1:-1] == k) | (gt[1:-1] == k)).flatten(1).sum(1).float()
            stats[0] += torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union)).mean()
            stats[1] += 1
    distributed.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).item()


def main():
    local_rank = para["local_rank"]
    torch.cuda.set_device(local_rank)
    distributed.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = distributed.get_rank(), distributed.get_world_size()
    print(f"I am rank {rank} in this world of size {world_size}!")
    torch.manual_seed(14159265)
    random.seed(14159265 + rank)
    np.random.seed(14159265 + rank)

    long_id = datetime.datetime.now().strftime("%b%d_%H.%M.%S_") + para["id"]
    save_dir = path.join("saves", long_id)
    writer = SummaryWriter(path.join("log", long_id)) if rank == 0 else None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    model = STCN().cuda()
    if para["load_network"]:
        src = torch.load(para["load_network"], map_location="cpu")
        if "value_trunk.0.weight" in src and src["value_trunk.0.weight"].shape[1] == 4:
            pads = torch.zeros_like(src["value_trunk.0.weight"][:, :1])
            src["value_trunk.0.weight"] = torch.cat([src["value_trunk.0.weight"], pads], 1)
        model.load_state_dict(src)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank,
                                                broadcast_buffers=False)
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=para["lr"], weight_decay=1e-7)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, para["steps"], para["gamma"])
    scaler = torch.cuda.amp.GradScaler(enabled=para["amp"])

    total_iter = 0
    if para["load_model"]:
        ckpt = torch.load(para["load_model"], map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        total_iter = ckpt["it"]

    yv = VOSTrainDataset(path.join(para["yv_root"], "JPEGImages"), path.join(para["yv_root"], "Annotations"),
                         para["max_skip"] // 4, para["num_frames"], para["max_objects"])
    davis = VOSTrainDataset(path.join(para["davis_root"], "JPEGImages", "480p"),
                            path.join(para["davis_root"], "Annotations", "480p"),
                            para["max_skip"], para["num_frames"], para["max_objects"],
                            subset=set(open(path.join(para["davis_root"], "ImageSets", "2017", "train.txt")).read().split()))
    train_dataset = ConcatDataset([davis] * 5 + [yv])
    sampler = DistributedSampler(train_dataset, rank=rank, shuffle=True)
    loader = DataLoader(train_dataset, para["batch_size"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    total_epoch = math.ceil(para["iterations"] / len(loader))
    current_epoch = total_iter // len(loader)
    if rank == 0:
        print(f"Training set size {len(train_dataset)}, {len(loader)} iterations per epoch, {total_epoch} epochs")

    model.train()
    for e in range(current_epoch, total_epoch):
        sampler.set_epoch(e)
        for data in loader:
            data = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in data.items()}
            with torch.cuda.amp.autocast(enabled=para["amp"]):
                out = run_clip(model, data)
                losses = compute_loss(out, data, total_iter)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(losses["total"]).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            total_iter += 1

            if rank == 0 and total_iter % para["report_every"] == 0:
                for k, v in losses.items():
                    writer.add_scalar(f"train/{k}", v.item(), total_iter)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], total_iter)
                print(f"[{total_iter}] loss {losses['total'].item():.4f}")
            if total_iter % para["eval_every"] == 0:
                j = evaluate(model.module, para["davis_root"], rank, world_size)
                if rank == 0:
                    writer.add_scalar("val/davis17_J", j, total_iter)
                    print(f"[{total_iter}] DAVIS-17 val J {j:.4f}")
            if rank == 0 and total_iter % para["save_every"] == 0:
                torch.save({"it": total_iter, "network": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                           path.join(save_dir, f"checkpoint_{total_iter}.pth"))
                torch.save(model.module.state_dict(), path.join(save_dir, f"model_{total_iter}.pth"))
            if total_iter >= para["iterations"]:
                break

    if rank == 0:
        torch.save(model.module.state_dict(), path.join(save_dir, "model_final.pth"))
        writer.close()
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
