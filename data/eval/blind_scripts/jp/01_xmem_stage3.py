"""
Stage-3 main training of an XMem-style memory network on DAVIS-2017 + YouTube-VOS.

    torchrun --nproc_per_node=8 train_xmem.py --davis_root ../DAVIS/2017/trainval \
        --yv_root ../YouTube/train_480p --exp_id s3_retrain
"""
import argparse
import datetime
import math
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
from torchvision import transforms
from torchvision.ops import FrozenBatchNorm2d


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--davis_root", default="../DAVIS/2017/trainval")
    p.add_argument("--yv_root", default="../YouTube/train_480p")
    p.add_argument("--exp_id", default="s3")
    p.add_argument("--batch_size", type=int, default=16, help="global batch size")
    p.add_argument("--num_frames", type=int, default=8)
    p.add_argument("--max_num_obj", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--iterations", type=int, default=110000)
    p.add_argument("--steps", type=int, nargs="*", default=[80000])
    p.add_argument("--key_dim", type=int, default=64)
    p.add_argument("--value_dim", type=int, default=512)
    p.add_argument("--hidden_dim", type=int, default=64)
    p.add_argument("--deep_update_prob", type=float, default=0.2)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--load_network", default=None)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


# ----------------------------------------------------------------------------- data
im_normalization = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])


class VOSDataset(Dataset):
    """Samples `num_frames` frames of a video with bounded temporal jumps."""

    def __init__(self, im_root, gt_root, max_jump, num_frames=8, max_num_obj=3, size=384):
        self.im_root, self.gt_root = im_root, gt_root
        self.max_jump, self.num_frames, self.max_num_obj, self.size = max_jump, num_frames, max_num_obj, size
        self.videos, self.frames = [], {}
        for vid in sorted(os.listdir(im_root)):
            frames = sorted(os.listdir(path.join(im_root, vid)))
            if len(frames) < num_frames:
                continue
            self.frames[vid] = frames
            self.videos.append(vid)
        self.jitter = transforms.ColorJitter(0.1, 0.03, 0.03, 0)
        self.crop = transforms.RandomResizedCrop(size, scale=(0.36, 1.0), ratio=(0.7, 1.3))

    def __len__(self):
        return len(self.videos)

    def _sample_indices(self, n):
        idx = [random.randrange(n)]
        while len(idx) < self.num_frames:
            lo, hi = max(0, idx[-1] - self.max_jump), min(n, idx[-1] + self.max_jump + 1)
            cand = [i for i in range(lo, hi) if i not in idx]
            if not cand:
                cand = [i for i in range(n) if i not in idx]
            idx.append(random.choice(cand))
        idx = sorted(idx)
        return idx[::-1] if random.random() < 0.5 else idx

    def __getitem__(self, idx):
        vid = self.videos[idx]
        frames = self.frames[vid]
        for _ in range(5):
            ids = self._sample_indices(len(frames))
            i, j, h, w = self.crop.get_params(Image.open(path.join(self.im_root, vid, frames[ids[0]])), self.crop.scale, self.crop.ratio)
            imgs, masks = [], []
            for f in ids:
                im = Image.open(path.join(self.im_root, vid, frames[f])).convert("RGB")
                gt = Image.open(path.join(self.gt_root, vid, frames[f][:-4] + ".png")).convert("P")
                im = transforms.functional.resized_crop(im, i, j, h, w, [self.size, self.size])
                gt = transforms.functional.resized_crop(gt, i, j, h, w, [self.size, self.size], interpolation=transforms.InterpolationMode.NEAREST)
                imgs.append(im_normalization(transforms.functional.to_tensor(self.jitter(im))))
                masks.append(np.array(gt))
            labels = [l for l in np.unique(masks[0]) if l != 0]
            if labels:
                break
        masks = np.stack(masks)
        target = random.sample(labels, min(len(labels), self.max_num_obj)) if labels else []
        cls_gt = np.zeros((self.num_frames, 1, self.size, self.size), dtype=np.int64)
        first_frame_gt = np.zeros((1, self.max_num_obj, self.size, self.size), dtype=np.int64)
        for k, l in enumerate(target):
            this = masks == l
            cls_gt[:, 0][this] = k + 1
            first_frame_gt[0, k] = this[0]
        selector = torch.tensor([1.0] * len(target) + [0.0] * (self.max_num_obj - len(target)))
        return {"rgb": torch.stack(imgs), "first_frame_gt": torch.from_numpy(first_frame_gt),
                "cls_gt": torch.from_numpy(cls_gt), "selector": selector, "num_objects": len(target)}


# ----------------------------------------------------------------------------- model
class KeyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3 = r.layer1, r.layer2, r.layer3

    def forward(self, x):
        f4 = self.layer1(self.stem(x))
        f8 = self.layer2(f4)
        return self.layer3(f8), f8, f4


class ValueEncoder(nn.Module):
    def __init__(self, value_dim, hidden_dim):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        w = r.conv1.weight.data
        self.conv1 = nn.Conv2d(5, 64, 7, 2, 3, bias=False)
        self.conv1.weight.data = torch.cat([w, torch.zeros(64, 2, 7, 7)], 1)
        self.body = nn.Sequential(r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.fuse = nn.Conv2d(1024 + 256, value_dim, 3, padding=1)
        self.hidden_reinforce = nn.Conv2d(value_dim + hidden_dim, hidden_dim * 3, 3, padding=1)

    def forward(self, image, f16, h16, masks, others, is_deep_update=True):
        b, k = masks.shape[:2]
        g = torch.stack([masks, others], 2).flatten(0, 1)
        x = torch.cat([image.unsqueeze(1).expand(-1, k, -1, -1, -1).flatten(0, 1), g], 1)
        x = self.body(self.conv1(x))
        x = self.fuse(torch.cat([x, f16.unsqueeze(1).expand(-1, k, -1, -1, -1).flatten(0, 1)], 1))
        x = x.view(b, k, *x.shape[1:])
        if is_deep_update:
            gates = self.hidden_reinforce(torch.cat([x, h16], 2).flatten(0, 1)).view(b, k, -1, *x.shape[-2:])
            hd = h16.shape[2]
            forget, update, new = torch.sigmoid(gates[:, :, :hd]), torch.sigmoid(gates[:, :, hd:2 * hd]), torch.tanh(gates[:, :, 2 * hd:])
            h16 = forget * h16 * (1 - update) + update * new
        return x, h16


class Decoder(nn.Module):
    def __init__(self, value_dim, hidden_dim):
        super().__init__()
        self.fuser = nn.Conv2d(value_dim + hidden_dim + 1024, 512, 3, padding=1)
        self.up_16_8 = nn.Conv2d(512 + 512, 256, 3, padding=1)
        self.up_8_4 = nn.Conv2d(256 + 256, 256, 3, padding=1)
        self.hidden_update = nn.Conv2d(512 + hidden_dim, hidden_dim * 3, 3, padding=1)
        self.pred = nn.Conv2d(256, 1, 3, padding=1)

    def forward(self, f16, f8, f4, readout, hidden, h_out=True):
        b, k = readout.shape[:2]
        rep = lambda t: t.unsqueeze(1).expand(-1, k, -1, -1, -1).flatten(0, 1)
        g16 = F.relu(self.fuser(torch.cat([rep(f16), readout.flatten(0, 1), hidden.flatten(0, 1)], 1)))
        g8 = F.relu(self.up_16_8(torch.cat([F.interpolate(g16, scale_factor=2, mode="bilinear", align_corners=False), rep(f8)], 1)))
        g4 = F.relu(self.up_8_4(torch.cat([F.interpolate(g8, scale_factor=2, mode="bilinear", align_corners=False), rep(f4)], 1)))
        logits = F.interpolate(self.pred(g4), scale_factor=4, mode="bilinear", align_corners=False)
        logits = logits.view(b, k, *logits.shape[-2:])
        if h_out:
            gates = self.hidden_update(torch.cat([g16, hidden.flatten(0, 1)], 1)).view(b, k, -1, *g16.shape[-2:])
            hd = hidden.shape[2]
            forget, update, new = torch.sigmoid(gates[:, :, :hd]), torch.sigmoid(gates[:, :, hd:2 * hd]), torch.tanh(gates[:, :, 2 * hd:])
            hidden = forget * hidden * (1 - update) + update * new
        return hidden, logits


def aggregate(prob, dim):
    new_prob = torch.cat([torch.prod(1 - prob, dim=dim, keepdim=True), prob], dim).clamp(1e-7, 1 - 1e-7)
    return torch.log(new_prob / (1 - new_prob))


class XMem(nn.Module):
    def __init__(self, key_dim=64, value_dim=512, hidden_dim=64):
        super().__init__()
        self.key_dim, self.value_dim, self.hidden_dim = key_dim, value_dim, hidden_dim
        self.key_encoder = KeyEncoder()
        self.value_encoder = ValueEncoder(value_dim, hidden_dim)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.d_proj = nn.Conv2d(1024, 1, 3, padding=1)
        self.e_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.decoder = Decoder(value_dim, hidden_dim)

    def encode_key(self, frame):
        b, t = frame.shape[:2]
        f16, f8, f4 = self.key_encoder(frame.flatten(0, 1))
        key = self.key_proj(f16)
        shrinkage = self.d_proj(f16) ** 2 + 1
        selection = torch.sigmoid(self.e_proj(f16))
        unflat = lambda x: x.view(b, t, *x.shape[1:])
        key, shrinkage, selection = [unflat(x).transpose(1, 2).contiguous() for x in (key, shrinkage, selection)]
        return key, shrinkage, selection, unflat(f16), unflat(f8), unflat(f4)

    def encode_value(self, frame, f16, h16, masks, is_deep_update=True):
        k = masks.shape[1]
        others = torch.stack([masks[:, [j for j in range(k) if j != i]].sum(1) for i in range(k)], 1) if k > 1 else torch.zeros_like(masks)
        return self.value_encoder(frame, f16, h16, masks, others, is_deep_update)

    def read_memory(self, qk, qe, mk, ms, mv):
        # qk: B CK H W, mk: B CK T H W, mv: B K CV T H W
        b, ck, h, w = qk.shape
        mk, ms = mk.flatten(2), ms.flatten(2)
        qk, qe = qk.flatten(2), qe.flatten(2)
        a_sq = mk.pow(2).transpose(1, 2) @ qe
        two_ab = 2 * (mk.transpose(1, 2) @ (qk * qe))
        b_sq = (qe * qk.pow(2)).sum(1, keepdim=True)
        sim = (-a_sq + two_ab - b_sq) * ms.transpose(1, 2) / math.sqrt(ck)
        aff = F.softmax(sim, dim=1)
        k, cv = mv.shape[1:3]
        out = mv.flatten(3).flatten(1, 2) @ aff
        return out.view(b, k, cv, h, w)

    def segment(self, feats, readout, hidden, selector=None, h_out=True):
        hidden, logits = self.decoder(*feats, readout, hidden, h_out=h_out)
        prob = torch.sigmoid(logits)
        if selector is not None:
            prob = prob * selector
        logits = aggregate(prob, dim=1)
        return hidden, logits, F.softmax(logits, dim=1)

    def forward(self, mode, *args, **kwargs):
        if mode == "encode_key":
            return self.encode_key(*args, **kwargs)
        if mode == "encode_value":
            return self.encode_value(*args, **kwargs)
        if mode == "read_memory":
            return self.read_memory(*args, **kwargs)
        if mode == "segment":
            return self.segment(*args, **kwargs)
        raise NotImplementedError(mode)


# ----------------------------------------------------------------------------- training
def bootstrapped_ce(logits, target, it, start_warm=20000, end_warm=70000, top_p=0.15):
    raw = F.cross_entropy(logits, target, reduction="none").view(-1)
    if it < start_warm:
        return raw.mean()
    this_p = 1.0 if it > end_warm else 1.0 - (1.0 - top_p) * (it - start_warm) / (end_warm - start_warm)
    loss, _ = torch.topk(raw, int(raw.numel() * this_p), sorted=False)
    return loss.mean()


def do_pass(model, data, num_frames, deep_update_prob):
    frames = data["rgb"]
    first_frame_gt = data["first_frame_gt"].float()
    b, num_objects = first_frame_gt.shape[0], first_frame_gt.shape[2]
    selector = data["selector"].unsqueeze(2).unsqueeze(2)

    key, shrinkage, selection, f16, f8, f4 = model("encode_key", frames)
    hidden = torch.zeros((b, num_objects, model.hidden_dim, *key.shape[-2:]), device=frames.device)
    v16, hidden = model("encode_value", frames[:, 0], f16[:, 0], hidden, first_frame_gt[:, 0])
    values = v16.unsqueeze(3)

    all_logits = []
    for ti in range(1, num_frames):
        if ti <= 5:
            ref_keys, ref_shrink, ref_values = key[:, :, :ti], shrinkage[:, :, :ti], values
        else:
            keep = sorted([0] + random.sample(range(1, ti), 4))
            ref_keys, ref_shrink, ref_values = key[:, :, keep], shrinkage[:, :, keep], values[:, :, :, keep]
        readout = model("read_memory", key[:, :, ti], selection[:, :, ti], ref_keys, ref_shrink, ref_values)
        hidden, logits, masks = model("segment", (f16[:, ti], f8[:, ti], f4[:, ti]), readout, hidden, selector,
                                      h_out=ti < num_frames - 1)
        if ti < num_frames - 1:
            is_deep_update = np.random.rand() < deep_update_prob
            v16, hidden = model("encode_value", frames[:, ti], f16[:, ti], hidden, masks[:, 1:], is_deep_update=is_deep_update)
            values = torch.cat([values, v16.unsqueeze(3)], 3)
        all_logits.append(logits)
    return all_logits


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(14159265 + rank)
    np.random.seed(14159265 + rank)
    random.seed(14159265 + rank)

    writer = SummaryWriter(path.join("saves", args.exp_id, "tb")) if rank == 0 else None

    net = XMem(args.key_dim, args.value_dim, args.hidden_dim).to(device)
    if args.load_network is not None:
        sd = torch.load(args.load_network, map_location="cpu")
        net.load_state_dict(sd)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)

    optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.steps, 0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    davis = VOSDataset(path.join(args.davis_root, "JPEGImages", "480p"), path.join(args.davis_root, "Annotations", "480p"),
                       max_jump=5, num_frames=args.num_frames, max_num_obj=args.max_num_obj)
    yv = VOSDataset(path.join(args.yv_root, "JPEGImages"), path.join(args.yv_root, "CleanedAnnotations"),
                    max_jump=5, num_frames=args.num_frames, max_num_obj=args.max_num_obj)
    train_set = ConcatDataset([davis] * 5 + [yv])
    sampler = DistributedSampler(train_set, rank=rank, num_replicas=world_size, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2 ** 31 + w))

    total_epoch = math.ceil(args.iterations / len(loader))
    it = 0
    for epoch in range(total_epoch):
        sampler.set_epoch(epoch)
        model.train()
        for data in loader:
            data = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in data.items()}
            with torch.cuda.amp.autocast(enabled=args.amp):
                all_logits = do_pass(model, data, args.num_frames, args.deep_update_prob)
                loss = 0
                for ti, logits in enumerate(all_logits, start=1):
                    loss = loss + bootstrapped_ce(logits, data["cls_gt"][:, ti, 0], it)
                loss = loss / len(all_logits)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            it += 1

            if rank == 0 and it % args.log_every == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], it)
                print(f"[{datetime.datetime.now():%H:%M:%S}] it {it} loss {loss.item():.4f}", flush=True)
            if rank == 0 and it % args.save_every == 0:
                os.makedirs(path.join("saves", args.exp_id), exist_ok=True)
                torch.save(model.module.state_dict(), path.join("saves", args.exp_id, f"network_{it}.pth"))
            if it >= args.iterations:
                break
        if it >= args.iterations:
            break

    if rank == 0:
        torch.save(model.module.state_dict(), path.join("saves", args.exp_id, "network_final.pth"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
